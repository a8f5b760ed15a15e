"""Reading Parquet row groups, for the Ray Data read tasks of the ranks' reader
(worker/ingest.py), and staging a local file where every node reads it. pyarrow only: a read
task's process imports nothing heavier, so it starts quickly on any node, CPU-only ones
included."""

from __future__ import annotations

import functools
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["filesystem_and_path", "parquet_file", "read_groups", "stage_file", "warm"]


def filesystem_and_path(location: str):
    """(pyarrow filesystem, path on it) of a local path or a URI pyarrow knows (s3://, gs://,
    ...)."""
    from pyarrow import fs

    if "://" in location:
        return fs.FileSystem.from_uri(location)
    return fs.LocalFileSystem(), location


def read_bytes(location: str) -> bytes | None:
    """The bytes of the file at a local path or URI; None when there is no such file. Decoding
    is the reader's: a file that is not UTF-8 text is then a damaged file it names (`json.loads`
    decodes bytes and raises a ValueError), not a traceback here."""
    from pyarrow import fs

    filesystem, path = filesystem_and_path(location)
    if filesystem.get_file_info(path).type != fs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as f:
        return f.read()


@functools.lru_cache(maxsize=32)
def parquet_file(source: str, path: str) -> pq.ParquetFile:
    """An open file, kept by the process that runs read tasks: its footer (the row groups'
    metadata, megabytes for a large file of small groups) is parsed once, not once a task."""
    try:
        return pq.ParquetFile(filesystem_and_path(source)[0].open_input_file(path))
    except (FileNotFoundError, OSError) as exc:
        raise FileNotFoundError(
            f"{path} cannot be opened on this node ({exc}); every node that runs read tasks "
            "must reach the data: give a URI (s3://, gs://) or a shared filesystem"
        ) from None


def read_groups(batch: pa.Table, source: str, columns: list[str]) -> pa.Table:
    """A Ray Data read task: the row groups `batch` lists (`file`, `group`), in that order, one
    table. Runs wherever Ray Data schedules it; per-row preparation belongs here."""
    parts = [
        parquet_file(source, path).read_row_group(group, columns=columns)
        for path, group in zip(
            batch.column("file").to_pylist(), batch.column("group").to_pylist(), strict=True
        )
    ]
    return pa.concat_tables(parts, promote_options="permissive")


def warm() -> bool:
    """A task that only loads this module: run early, it leaves a worker process ready for
    the first read task (a new one takes seconds to start on a small machine)."""
    return True


def stage_file(path: str, storage: str) -> str:
    """A copy of the local Parquet file `path` under `storage` (a path or URI every node
    reaches: the run's storage path), made once; its path there."""
    from pyarrow import fs

    name = Path(path).name
    filesystem, root = filesystem_and_path(storage)
    target = f"{root}/_data/{name}"
    info = filesystem.get_file_info(target)
    if info.type != fs.FileType.File or info.size != Path(path).stat().st_size:
        filesystem.create_dir(f"{root}/_data", recursive=True)
        # written under a name of its own, then renamed: a concurrent run (sweep trials share
        # the storage path) never reads a partial file (a rename is atomic on a filesystem; an
        # object store's upload appears whole)
        partial = f"{target}.{uuid.uuid4().hex}.partial"
        fs.copy_files(path, partial, fs.LocalFileSystem(), filesystem)
        filesystem.move(partial, target)
    return target if "://" not in storage else f"{storage.rstrip('/')}/_data/{name}"
