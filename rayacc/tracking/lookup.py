"""What `rayacc report TARGET` names: a run (its MLflow id, or its rayacc name as `sample`,
`export` and `--resume` take it), an experiment (its latest sweep, or its latest run when it
holds none), or a sweep by its name; when nothing matches, what the store holds."""

from __future__ import annotations

import re

__all__ = ["ReportError", "resolve_parent", "single_run"]


class ReportError(ValueError):
    pass


def single_run(client, target: str):
    """The MLflow run `target` names when it is not a sweep's parent, or the latest run of the
    experiment `target` when that experiment holds no sweep; None for a sweep."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(target)
    except MlflowException:
        run = None
    if run is not None:
        return None if run.data.tags.get("rayacc.sweep") == "true" else run
    named = _by_run_name(client, target)
    if named is not None:
        return named
    exp = client.get_experiment_by_name(target)
    if exp is None:
        return None
    sweeps = client.search_runs(
        [exp.experiment_id], filter_string="tags.`rayacc.sweep` = 'true'", max_results=1
    )
    if sweeps:
        return None
    latest = client.search_runs(
        [exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1
    )
    return latest[0] if latest else None


_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
"""What a rayacc run name is made of (`run.name`): nothing a filter string would read as more."""


def _by_run_name(client, target: str):
    """The newest MLflow run of the rayacc run called `target` (a resume into another store
    starts one there), or None."""
    if not _RUN_NAME.fullmatch(target):
        return None
    runs = _newest(client, f"tags.`rayacc.run_name` = '{target}'", 1)
    return runs[0] if runs else None


def _sweeps(client) -> list:
    """Every sweep's parent run in the store, newest first."""
    return _newest(client, "tags.`rayacc.sweep` = 'true'", 1000)


def _newest(client, filter_string: str, most: int) -> list:
    """The runs of every experiment of the store that `filter_string` selects, newest first."""
    ids = [e.experiment_id for e in client.search_experiments()]
    if not ids:
        return []
    return client.search_runs(
        ids, filter_string=filter_string, order_by=["attributes.start_time DESC"], max_results=most
    )


def _what_exists(client, sweeps: list) -> str:
    """The store's experiments and its newest sweeps, for a name that matched nothing."""
    experiments = [e.name for e in client.search_experiments()][:10]
    names = list(dict.fromkeys(r.info.run_name for r in sweeps))[:10]
    return f"experiments: {', '.join(experiments) or 'none'}; sweeps: {', '.join(names) or 'none'}"


def resolve_parent(client, target: str) -> str:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(target).info.run_id
    except MlflowException:
        pass
    exp = client.get_experiment_by_name(target)
    if exp is None:
        sweeps = _sweeps(client)
        named = [r for r in sweeps if r.info.run_name == target]
        if named:
            return max(named, key=lambda r: r.info.start_time).info.run_id
        raise ReportError(
            f"{target!r} is neither an MLflow run id, a run's name, an experiment nor a sweep's "
            f"name in this tracking store ({_what_exists(client, sweeps)}). Fix: pass a run's "
            "name (`rayacc runs` lists them), a sweep's name (its sweep file's `name:`), its "
            "parent run id or its experiment"
        )
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string="tags.`rayacc.sweep` = 'true'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        raise ReportError(f"experiment {target!r} holds no sweep. Fix: run `rayacc sweep` first")
    return runs[0].info.run_id
