"""Everything rayacc stores in MLflow passes the one seam (tracking/mlflow_sink.py), which masks
it: the calls that write to MLflow are found in the code itself (every module, today's and
tomorrow's) and must be the seam's; the seam's file uploads mask text as its texts and tags
are masked."""

from __future__ import annotations

import ast
from pathlib import Path

from mlflow.tracking import MlflowClient

import rayacc
from rayacc.tracking.mlflow_sink import TEXT_SUFFIXES, MlflowSink, log_files, tag_run

ROOT = Path(rayacc.__file__).parent
SEAM = ROOT / "tracking" / "mlflow_sink.py"
WRITES = {
    "log_artifact", "log_artifacts", "log_text", "log_dict", "log_param", "log_params",
    "log_metric", "log_metrics", "log_batch", "set_tag", "set_tags", "log_figure", "log_image",
    "log_table", "log_inputs", "log_input", "log_model", "set_experiment_tag", "create_run",
}  # fmt: skip
"""MLflow's calls that store something (the client's and the fluent module's)."""
SECRET_URI = "http://alice:s3cr3t@mlflow.internal:5000"


def _is_client(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == "MlflowClient") or (
        isinstance(func, ast.Attribute) and func.attr == "MlflowClient"
    )


def raw_writes(source: str) -> list[str]:
    """`line: call` of each MLflow write on a client or on `mlflow` itself (not the seam's)."""
    tree = ast.parse(source)
    clients = {"mlflow", "client"}
    for node in ast.walk(tree):
        call = isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        if call and _is_client(node.value.func):
            clients |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = node.func.value
        raw = (isinstance(receiver, ast.Call) and _is_client(receiver.func)) or (
            isinstance(receiver, ast.Name) and receiver.id in clients
        )
        if raw and node.func.attr in WRITES:
            found.append(f"{node.lineno}: {ast.unparse(node.func)}")
    return found


def test_the_finder_finds_what_it_is_for():
    assert raw_writes("MlflowClient(u).set_tag(r, 'k', v)") == ["1: MlflowClient(u).set_tag"]
    assert raw_writes("c = MlflowClient(u)\nc.log_artifact(r, p)") == ["2: c.log_artifact"]
    assert raw_writes("import mlflow\nmlflow.log_param('k', v)") == ["2: mlflow.log_param"]
    assert raw_writes("sink.log_text(t, 'a.txt')\nclient.get_run(r)") == []


def test_every_write_to_mlflow_is_the_seams():
    outside = {
        str(path.relative_to(ROOT)): found
        for path in sorted(ROOT.rglob("*.py"))
        if path != SEAM and (found := raw_writes(path.read_text()))
    }
    assert outside == {}, f"write through rayacc/tracking/mlflow_sink.py: {outside}"


def test_the_seams_uploads_mask_text_files(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    texts = {f"f{suffix}": f"tracking_uri: {SECRET_URI}\n" for suffix in TEXT_SUFFIXES}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    sink = MlflowSink(uri, "exp", "run")
    for name in texts:
        sink.log_artifact(tmp_path / name)
    sink.finish()
    log_files(uri, sink.run_id, [tmp_path / n for n in texts], "report")
    tag_run(uri, sink.run_id, "rayacc.verified", f"PASS {SECRET_URI}")
    client = MlflowClient(uri)
    for name in texts:
        for where in (name, f"report/{name}"):
            got = Path(
                client.download_artifacts(sink.run_id, where, str(tmp_path / "dl"))
            ).read_text()
            assert "s3cr3t" not in got and "mlflow.internal" in got, (where, got)
    tag = client.get_run(sink.run_id).data.tags["rayacc.verified"]
    assert "s3cr3t" not in tag and tag.startswith("PASS"), tag
