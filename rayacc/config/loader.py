"""The one YAML loader of the files rayacc reads (job, sweep and plan files, cluster specs) and
of override values: safe YAML that refuses a key written twice in one mapping, at any depth
(YAML itself keeps the last and drops the first without a word)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from rayacc.config.errors import MISSING, ConfigError, ConfigIssue

__all__ = ["DuplicateKeyError", "load_yaml_text", "read_yaml"]


class DuplicateKeyError(yaml.YAMLError):
    """Keys written twice in one mapping: each as (dotted path, its first line, the repeat's
    line), lines counted from 1."""

    def __init__(self, found: list[tuple[str, int, int]]):
        self.found = found
        super().__init__(
            "; ".join(f"{path!r} written twice (lines {a} and {b})" for path, a, b in found)
        )

    def __reduce__(self):
        return type(self), (self.found,)


def _repeated_keys(node: yaml.Node, path: str, seen: set[int], found: list) -> None:
    if id(node) in seen:  # an alias: the node it names is checked where it stands
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then a key: an override
                continue
            name = key.value if isinstance(key, yaml.ScalarNode) else f"<{key.tag}>"
            where = f"{path}.{name}" if path else str(name)
            line = key.start_mark.line + 1
            if isinstance(key, yaml.ScalarNode) and name in first:
                found.append((where, first[name], line))
            first.setdefault(name, line)
            _repeated_keys(value, where, seen, found)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _repeated_keys(item, f"{path}[{i}]", seen, found)


MAX_VALUES = 100_000
"""The most values a file may hold with its aliases expanded: a few aliases of aliases make
billions (each level multiplies), which the checks after the parse would walk for hours."""


def _expanded(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values `node` holds with every alias in it expanded."""
    if id(node) not in sizes:
        sizes[id(node)] = 1  # a node that holds itself counts once
        if isinstance(node, yaml.MappingNode):
            sizes[id(node)] += sum(_expanded(k, sizes) + _expanded(v, sizes) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            sizes[id(node)] += sum(_expanded(item, sizes) for item in node.value)
    return sizes[id(node)]


def load_yaml_text(text: str) -> Any:
    """The parsed YAML of `text` (safe types only); a key written twice anywhere raises
    :class:`DuplicateKeyError`, bad YAML (nested deeper than the parser reaches, or more than
    `MAX_VALUES` values with its aliases expanded) `yaml.YAMLError`."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        found: list[tuple[str, int, int]] = []
        if node is not None:
            _repeated_keys(node, "", set(), found)
            if (values := _expanded(node, {})) > MAX_VALUES:
                raise yaml.YAMLError(
                    f"it holds {values:,} values with its aliases (&name, *name) expanded, more "
                    f"than {MAX_VALUES:,}"
                )
    except RecursionError:
        raise yaml.YAMLError("it is nested deeper than the parser follows") from None
    if found:
        raise DuplicateKeyError(found)
    return yaml.safe_load(text)


YAML_SUFFIXES = (".yaml", ".yml", ".json")
NOT_YAML = {
    ".py": "Python",
    ".toml": "TOML",
    ".ini": "INI",
    ".cfg": "INI",
    ".sh": "shell",
    ".ipynb": "notebook",
    ".parquet": "Parquet",
    ".txt": "text",
    ".md": "Markdown",
    ".pt": "PyTorch",
    ".csv": "CSV",
}
"""Suffixes of files people pass where YAML belongs (a file without a suffix is read)."""


def read_yaml(
    path: str | os.PathLike, kind: str, example: str, max_bytes: int | None = None
) -> Any:
    """The parsed contents of the YAML (or JSON) file at `path`; a missing, empty or (over
    `max_bytes`) oversized file, bad YAML or a key written twice is a ConfigError naming the
    file. `kind` and `example` (how the file is given, e.g. `-c jobs/digits.yaml`) word the
    fix."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    f"{kind} file not found",
                    str(p),
                    f"pass an existing YAML file, e.g. {example}",
                )
            ],
            str(p),
        )
    if p.suffix.lower() not in YAML_SUFFIXES and p.suffix.lower() in NOT_YAML:
        # a job written in Python (or another format) would parse as YAML into nonsense, or
        # fail deep in the parser: named for what it is
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    f"a {NOT_YAML[p.suffix.lower()]} file, not YAML: a {kind} file is YAML "
                    "(or JSON); rayacc runs no code from it",
                    MISSING,
                    f"write the {kind} as YAML, e.g. {example}",
                )
            ],
            str(p),
        )
    if max_bytes is not None and (size := p.stat().st_size) > max_bytes:
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    f"{size} bytes: more than a {kind} file holds ({max_bytes} at most)",
                    MISSING,
                    f"pass the {kind} file itself, e.g. {example}",
                )
            ],
            str(p),
        )
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    f"not a text file (byte {exc.start} is not UTF-8)",
                    MISSING,
                    f"pass the {kind} YAML file itself, e.g. {example}",
                )
            ],
            str(p),
        ) from None
    except OSError as exc:
        raise ConfigError(
            [ConfigIssue("", f"cannot be read ({exc.strerror})", MISSING, "check its permissions")],
            str(p),
        ) from None
    try:
        data = load_yaml_text(text)
        if data is None:
            raise ConfigError(
                [
                    ConfigIssue(
                        "",
                        f"the {kind} file is empty (or holds only comments)",
                        MISSING,
                        f"pass the {kind} file itself, e.g. {example} (`{{}}` alone takes "
                        "every default)",
                    )
                ],
                str(p),
            )
        return data
    except DuplicateKeyError as exc:
        raise ConfigError(
            [
                ConfigIssue(
                    path,
                    f"written twice (line {a} and line {b}): YAML would keep the second and "
                    "drop the first without a word",
                    MISSING,
                    "keep one of them (merge what both say into it)",
                )
                for path, a, b in exc.found
            ],
            str(p),
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            [ConfigIssue("", f"not valid YAML: {exc}", MISSING, "correct the YAML syntax")],
            str(p),
        ) from None
