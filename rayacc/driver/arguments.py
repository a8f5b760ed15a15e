"""The kinds of value the command line's flags and arguments take. Each kind is an argparse
type: it checks one value when the line is parsed, so a malformed one is refused (exit 2,
argparse naming the flag, the kind's message saying what is wrong and the fix) before the
command does any work — no file written, no cluster asked. Every flag that takes a value has
one (tests/unit/cli/test_boundaries.py walks the parser and feeds each its `malformed` value)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

from rayacc.redact import redact

__all__ = [
    "Address",
    "ExistingFile",
    "Factory",
    "Folder",
    "Kind",
    "Name",
    "NewFile",
    "Number",
    "Override",
    "Overrides",
    "Storage",
    "Switch",
    "Text",
    "TrackingUri",
    "environment_problems",
    "variable_kinds",
]


class Kind:
    """An argparse type with the example of a value it refuses."""

    malformed: str | None = None
    """A value this kind refuses (None: every value is one of its kind)."""

    def __call__(self, text: str) -> Any:
        problem = self.problem(text)
        if problem:
            raise argparse.ArgumentTypeError(redact(problem))
        return self.convert(text)

    def problem(self, text: str) -> str | None:
        raise NotImplementedError

    def convert(self, text: str) -> Any:
        return text

    @property
    def __name__(self) -> str:  # argparse names the type in a few of its own messages
        return type(self).__name__.lower()


class Number(Kind):
    """A number of `kind` (int or float) at least `low` (above it, with `above`)."""

    malformed = "x"

    def __init__(self, kind: type, low: float, *, above: bool = False):
        self.kind, self.low, self.above = kind, low, above
        self.bound = f"> {low:g}" if above else f"≥ {low:g}"

    def problem(self, text: str) -> str | None:
        try:
            value = self.kind(text)
        except ValueError:
            return f"{text!r} is not a number {self.bound}"
        if value != value or value in (float("inf"), float("-inf")):
            return f"must be a finite number {self.bound} (got {text})"
        if value < self.low or (self.above and value == self.low):
            return f"must be {self.bound} (got {text})"
        return None

    def convert(self, text: str) -> Any:
        return self.kind(text)


class Name(Kind):
    """Non-empty text on one line: a name or an id (`what` says which)."""

    malformed = ""

    def __init__(self, what: str):
        self.what = what

    def problem(self, text: str) -> str | None:
        if not text.strip():
            return f"is empty. Fix: give {self.what}"
        if any(ord(c) < 32 for c in text):
            return f"holds a line break or a control character. Fix: give {self.what}"
        return None


class Text(Kind):
    """Any text (a prompt): nothing to refuse."""

    def problem(self, text: str) -> str | None:
        return None


class ExistingFile(Name):
    """A local file that exists (`what`: e.g. "the job's YAML file")."""

    malformed = "no-such-file.yaml"

    def problem(self, text: str) -> str | None:
        if bad := super().problem(text):
            return bad
        path = Path(text).expanduser()
        if path.is_dir():
            return f"{text!r} is a folder. Fix: give {self.what}"
        if not path.is_file():
            return f"no such file {text!r}. Fix: give {self.what}"
        return None


class ExistingPath(Name):
    """A local file or folder that exists (`what`: e.g. "a tokenizer folder")."""

    malformed = "no-such-path"

    def problem(self, text: str) -> str | None:
        if bad := super().problem(text):
            return bad
        if not Path(text).expanduser().exists():
            return f"no such file or folder {text!r}. Fix: give {self.what}"
        return None


class Folder(Kind):
    """A local folder rayacc writes in: one that is writable, or can be made. `whole`: one
    written whole, staged beside it and renamed into place, so a link there is refused (the
    rename would replace the link, not fill the folder it names)."""

    malformed = "/dev/null/folder"

    def __init__(self, flag: str, whole: bool = False):
        self.flag, self.whole = flag, whole

    def problem(self, text: str) -> str | None:
        from rayacc.driver.places import check_folder, path_text_problem

        if not text.strip():
            return "is empty. Fix: name a folder"
        if self.whole and not path_text_problem(self.flag, text):
            path = Path(text).expanduser()
            if path.is_symlink():
                target = os.readlink(path)
                return (
                    f"{self.flag} {text!r} is a link (to {target!r}): the folder is written "
                    "beside it and renamed into place, which would replace the link. Fix: name "
                    "the folder itself, or a new one"
                )
        return check_folder(self.flag, text)


class NewFile(Folder):
    """A local file rayacc writes: not a folder, in a folder that is writable or can be made."""

    malformed = "/dev/null/file.yaml"

    def problem(self, text: str) -> str | None:
        from rayacc.driver.places import check_folder

        if not text.strip():
            return "is empty. Fix: name a file"
        path = Path(text).expanduser()
        if path.is_dir():
            return f"{self.flag}={text!r} is a folder. Fix: name a file"
        return check_folder(f"the folder of {self.flag}", str(path.parent))


class TrackingUri(Kind):
    """An MLflow tracking URI that holds runs (`report` reads them; `recorded=False`: one a
    run may create)."""

    malformed = "nope://tracking"

    def __init__(self, flag: str, recorded: bool = True):
        self.flag, self.recorded = flag, recorded

    def problem(self, text: str) -> str | None:
        from rayacc.driver.places import check_tracking_uri

        return check_tracking_uri(self.flag, text, recorded=self.recorded)


class Storage(Kind):
    """A run storage path: a local folder that exists, or a URI of a storage pyarrow opens."""

    malformed = "nope://bucket/runs"

    def problem(self, text: str) -> str | None:
        from rayacc.driver.places import storage_problem, storage_scheme_problem

        if not text.strip():
            return "is empty. Fix: give the run.storage_path the runs were trained with"
        if "://" in text:
            if problem := storage_scheme_problem(text):
                return f"{problem}, or a local path"
            return storage_problem("--storage", text)
        if not Path(text).expanduser().is_dir():
            return (
                f"{text!r}: no such folder. Fix: give the run.storage_path the runs were "
                "trained with"
            )
        return None


_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.\-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")
ADDRESS_SCHEMES = ("http", "https", "ray")


def address_problem(text: str) -> str | None:
    """Why `text` is not a Ray Jobs API address (`http://HOST:PORT`, `https://…`,
    `ray://…`, or `HOST:PORT`), None when it is one. Checked before any request: a mistyped
    one would be tried for tens of seconds before the client names it."""
    from rayacc.driver.places import shown

    fix = "Fix: give e.g. http://127.0.0.1:8265 (the dashboard's address)"
    rest, said = text.strip(), shown(text)
    if rest == "auto":  # Ray's own word for the cluster this machine belongs to
        return None
    schemed = "://" in rest
    if schemed:
        scheme, rest = rest.split("://", 1)
        if scheme.lower() not in ADDRESS_SCHEMES:
            return (
                f"{said}: {shown(scheme)}:// is not a Ray address scheme (http, https, ray). {fix}"
            )
    elif "/" in rest or not rest:
        return f"{said} is not an address (no scheme://, and not HOST:PORT). {fix}"
    hostport = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    host, _, port = hostport.rpartition(":") if not hostport.endswith("]") else (hostport, "", "")
    if not host:
        host, port = hostport, ""
    # a DNS name is at most 253 characters
    if len(host) > 253 or not _HOST.fullmatch(host):
        return f"{said}: {shown(host)} is not a host name or address. {fix}"
    if not schemed and not port:  # Ray takes a bare address as HOST:PORT only
        return f"{said} is not an address (no scheme://, and no :PORT). {fix}"
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        return f"{said}: port {shown(port)} is not a port number. {fix}"
    return None


class Address(Kind):
    """A Ray Jobs API address (see `address_problem`)."""

    malformed = "http//127.0.0.1:8265"

    def problem(self, text: str) -> str | None:
        return address_problem(text)


_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"


class Factory(Kind):
    """A model factory, `package.module:function`."""

    malformed = "no-colon"

    def problem(self, text: str) -> str | None:
        if not re.fullmatch(rf"{_DOTTED}:{_DOTTED}", text.strip()):
            return (
                f"{text!r} is not of the form package.module:function. Fix: e.g. mypkg.models:build"
            )
        return None


class Override(Kind):
    """A config override, `key.path=value` (the value parsed as YAML)."""

    malformed = "=1"

    def problem(self, text: str) -> str | None:
        key, sep, _ = text.partition("=")
        if not sep or not re.fullmatch(
            r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_\-]+)*", key.strip()
        ):
            return (
                f"{text!r} is not an override of the form key.path=value. Fix: write e.g. "
                "batch.micro_batch_size=16"
            )
        return None


class Overrides(Kind):
    """A JSON list of config overrides (`env.OVERRIDES`), each as `Override` takes it."""

    malformed = '["train.max_steps=3"'

    def problem(self, text: str) -> str | None:
        import json

        fix = "Fix: unset it (`rayacc submit` sets it for the job it submits)"
        try:
            items = json.loads(text)
        except ValueError:
            return f"is not JSON (a list of key.path=value strings). {fix}"
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            return f"is not a JSON list of key.path=value strings. {fix}"
        return next((p for i in items if (p := Override().problem(i))), None)


class Switch(Kind):
    """`1` (on), `0` or empty (off)."""

    malformed = "yes"

    def problem(self, text: str) -> str | None:
        return None if text in ("", "0", "1") else "is neither 1 (on) nor 0 (off). Fix: set 1 or 0"


def variable_kinds() -> dict[str, Kind]:
    """Each variable of `env.VARIABLES` as the kind of value it stands for: a flag's kind where
    it stands for a flag (or for the field a flag stands for too)."""
    from rayacc import env

    kinds = {
        "RAY_ADDRESS": Address(),
        "MLFLOW_TRACKING_URI": TrackingUri("$MLFLOW_TRACKING_URI", recorded=False),
        "MLFLOW_EXPERIMENT_NAME": Name("an MLflow experiment's name"),
        env.CACHE: Folder(f"${env.CACHE}"),
        env.OVERRIDES: Overrides(),
        env.VERBOSE: Switch(),
    }
    assert kinds.keys() == env.VARIABLES.keys(), "every variable has its kind"
    return kinds


def environment_problems(environ) -> list[str]:
    """Why each variable of `env.VARIABLES` set in `environ` cannot be used (its value shown
    shortened, never whole), checked as what it stands for: a command starts with none."""
    from rayacc import env
    from rayacc.driver.places import shown

    problems = []
    for name, kind in variable_kinds().items():
        value = environ.get(name)
        if value and (problem := kind.problem(value)):
            # the kinds quote the value they refuse: here the variable names it instead
            said = shown(value)
            for quoted, instead in ((f"${name}={said}", f"${name}"), (f"{said}: ", "")):
                problem = problem.replace(quoted, instead)
            problem = problem.replace(said, "the value")
            problems.append(redact(f"${name} (it stands for {env.VARIABLES[name]}): {problem}"))
    return problems
