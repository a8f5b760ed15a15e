"""The one seam between rayacc and the storage its runs live on: a local disk or anything
pyarrow reaches (`s3://`, `gs://`, `file://`). Every checkpoint, lease and run file rayacc writes
or reads back goes through it, so that what makes a file whole (written under a name of its own,
then moved) and what a reader refuses (a link, a folder where a file belongs) live in one place.

A `Storage` is rooted at a folder; every path it takes is relative to it and may not climb out
of it (`..`, an absolute path).
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

__all__ = ["ArrowStorage", "Entry", "NotAFile", "Storage", "open_storage"]

Kind = Literal["file", "dir", "link", "other"]


@dataclass(frozen=True)
class Entry:
    """One name in a folder of the storage."""

    name: str
    """Relative to the storage's root, `/`-separated."""
    kind: Kind
    size: int


class NotAFile(OSError):
    """A name that should be a regular file is a link, a folder or something else: a reader
    of untrusted folders does not follow it."""

    def __init__(self, location: str, kind: str):
        super().__init__(f"{location} is a {kind}, not a regular file")
        self.location, self.kind = location, kind

    def __reduce__(self):
        return (NotAFile, (self.location, self.kind))


class Storage(Protocol):
    """What rayacc asks of a storage: whole files in, listings, whole files out, deletes."""

    root: str
    """The local path or URI of the root folder."""

    def uri(self, relative: str = "") -> str: ...
    def put(self, relative: str, data: bytes) -> None: ...
    def put_file(self, relative: str, local: Path) -> None: ...
    def read(self, relative: str) -> bytes | None: ...
    def stat(self, relative: str) -> Entry | None: ...
    def list(self, relative: str = "") -> list[Entry]: ...
    def delete(self, relative: str) -> None: ...
    def child(self, relative: str) -> Storage: ...


def _inside(relative: str) -> str:
    parts = [p for p in relative.replace("\\", "/").split("/") if p not in ("", ".")]
    if relative.startswith("/") or ".." in parts:
        raise ValueError(f"{relative!r} is not a path inside the storage folder")
    return "/".join(parts)


class ArrowStorage:
    """A `Storage` over a pyarrow filesystem. A put is whole or absent: on a filesystem the
    bytes go to a name of their own and are renamed (atomic); an object store's put is atomic
    by itself. On a local disk links are seen as links (never followed)."""

    def __init__(self, root: str):
        from pyarrow import fs

        self.root = root.rstrip("/") if "://" in root else str(Path(root))
        if "://" in self.root:
            self._fs, self._path = fs.FileSystem.from_uri(self.root)
            self._path = self._path.rstrip("/")
        else:
            self._fs, self._path = fs.LocalFileSystem(), self.root
        self._local = isinstance(self._fs, fs.LocalFileSystem)
        # a rename is atomic on a filesystem; object stores have no rename, their put is whole
        self._renames = self._local or type(self._fs).__name__ in ("HadoopFileSystem",)

    # ------------------------------------------------------------------ names
    def uri(self, relative: str = "") -> str:
        relative = _inside(relative)
        return f"{self.root}/{relative}" if relative else self.root

    def _full(self, relative: str) -> str:
        relative = _inside(relative)
        return f"{self._path}/{relative}" if relative else self._path

    def child(self, relative: str) -> ArrowStorage:
        return ArrowStorage(self.uri(relative))

    # ------------------------------------------------------------------ writing
    def put(self, relative: str, data: bytes) -> None:
        target = self._full(relative)
        self._fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        partial = f"{target}.{uuid.uuid4().hex[:12]}.partial" if self._renames else target
        try:
            with self._fs.open_output_stream(partial) as out:
                out.write(data)
            if partial != target:
                self._fs.move(partial, target)
        finally:
            if partial != target:
                self._delete_quietly(partial)

    def put_file(self, relative: str, local: Path) -> None:
        from pyarrow import fs

        target = self._full(relative)
        self._fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        partial = f"{target}.{uuid.uuid4().hex[:12]}.partial" if self._renames else target
        try:
            if self._local:
                try:
                    # the same disk: a second name for the staged file, nothing copied
                    os.link(local, partial)
                except OSError:
                    shutil.copyfile(local, partial)  # the kernel's copy (copy_file_range)
            else:
                fs.copy_files(str(local), partial, fs.LocalFileSystem(), self._fs)
            if partial != target:
                self._fs.move(partial, target)
        finally:
            if partial != target:
                self._delete_quietly(partial)

    def delete(self, relative: str) -> None:
        """Deletes a file or a folder with everything in it; nothing there is no error."""
        entry = self.stat(relative)
        if entry is None:
            return
        if entry.kind == "dir":
            self._fs.delete_dir(self._full(relative))
        else:
            self._fs.delete_file(self._full(relative))

    def _delete_quietly(self, full: str) -> None:
        from pyarrow import fs

        try:
            if self._fs.get_file_info(full).type == fs.FileType.File:
                self._fs.delete_file(full)
        except OSError:
            pass  # what is left is a `.partial` no reader takes

    # ------------------------------------------------------------------ reading
    def stat(self, relative: str) -> Entry | None:
        full = self._full(relative)
        if self._local:
            try:
                st = os.lstat(full)
            except (FileNotFoundError, NotADirectoryError):
                return None
            return Entry(_inside(relative), _kind_of_mode(st.st_mode), st.st_size)
        from pyarrow import fs

        info = self._fs.get_file_info(full)
        if info.type == fs.FileType.NotFound:
            return None
        return Entry(_inside(relative), _arrow_kind(info.type), info.size or 0)

    def read(self, relative: str) -> bytes | None:
        """The whole file; None when nothing is there. A link, a folder or a device where a
        file belongs is refused (`NotAFile`)."""
        entry = self.stat(relative)
        if entry is None:
            return None
        if entry.kind != "file":
            raise NotAFile(self.uri(relative), entry.kind)
        full = self._full(relative)
        if self._local:
            # O_NOFOLLOW: a link swapped in after the look is not followed either
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                return f.read()
        with self._fs.open_input_stream(full) as f:
            return f.read()

    def list(self, relative: str = "") -> list[Entry]:
        """The names directly in a folder (none: empty), links as links."""
        base = _inside(relative)
        full = self._full(relative)
        if self._local:
            try:
                names = os.listdir(full)
            except (FileNotFoundError, NotADirectoryError):
                return []
            found = []
            for name in sorted(names):
                entry = self.stat(f"{base}/{name}" if base else name)
                if entry is not None:
                    found.append(entry)
            return found
        from pyarrow import fs

        infos = self._fs.get_file_info(fs.FileSelector(full, allow_not_found=True))
        return sorted(
            (
                Entry(
                    f"{base}/{i.base_name}" if base else i.base_name,
                    _arrow_kind(i.type),
                    i.size or 0,
                )
                for i in infos
            ),
            key=lambda e: e.name,
        )


def _kind_of_mode(mode: int) -> Kind:
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "other"


def _arrow_kind(kind) -> Kind:
    from pyarrow import fs

    return {fs.FileType.File: "file", fs.FileType.Directory: "dir"}.get(kind, "other")


def open_storage(root: str) -> Storage:
    """The storage rooted at a local path or URI."""
    return ArrowStorage(root)
