"""Checks of the committed cluster specs: Ray cluster launcher YAML (`launcher_spec`: Ray's own
JSON schema plus the rules Ray checks in code, and spot capacity as the agent runs on it) and
KubeRay manifests (`kuberay_spec`: a strict schema of the fields rayacc uses). Here: what both
share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["SpecError", "load_yaml", "schema_errors"]


class SpecError(ValueError):
    pass


def load_yaml(path: str | Path) -> Any:
    from rayacc.config.loader import load_yaml_text

    return load_yaml_text(Path(path).read_text())


def schema_errors(doc: Any, schema: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    ]
