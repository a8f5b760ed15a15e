"""Secrets known by where they come from, masked by value in every sink (rayacc/redact/): the
cases are generated from the definitions — every free-form mapping field of the config schema
× every secret word in every casing and separator, every field that names a place × a URI's
userinfo, every credential variable of `CREDENTIAL_VARIABLES` — and each is looked for in
every sink: the console stream, MLflow's params and its config artifact, a checkpoint's
`model.json` and identity, the run's info file, a submitted job's entrypoint. Then the
reviewer's shapes for the second net, and the console stream: a certificate's BEGIN line holds
nothing back, a 1.2 MB line in 4 KB pieces is read in linear time, rayacc's own lines are left
as they are."""

from __future__ import annotations

import io
import json
import time
import typing
from pathlib import Path

import pytest

from rayacc import TrainConfig
from rayacc.config.strings import may_hold_credentials
from rayacc.redact import KNOWN, SECRET_WORDS, RedactingStream, redact
from rayacc.redact.origins import CREDENTIAL_VARIABLES, register_config, register_environment

SECRET = "Zq7-hunter2-8vXwYtR4"
"""A value no shape of the second net finds on its own: only its origin tells."""


@pytest.fixture(autouse=True)
def _fresh_registry():
    KNOWN.clear()
    yield
    KNOWN.clear()


def _casings(words: str) -> list[str]:
    """One key in every casing and separator: snake, kebab, camel, Pascal, upper, dotted."""
    parts = words.split()
    return [
        "_".join(parts),
        "-".join(parts),
        parts[0] + "".join(p.title() for p in parts[1:]),
        "".join(p.title() for p in parts),
        "_".join(parts).upper(),
    ]


KEYS = sorted({k for word in SECRET_WORDS for k in _casings(f"hub {word}")})
"""Every secret word after another word, in every casing (`hub_token`, `HubToken`, …)."""


def _mapping_fields() -> list[str]:
    """The config's free-form mapping fields (any value at any depth), from the schema."""
    found = []

    def walk(model, prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if "dict[str, typing.Any]" in str(annotation):
                found.append(prefix + name)
            for arg in (annotation, *typing.get_args(annotation)):
                if hasattr(arg, "model_fields"):
                    walk(arg, f"{prefix}{name}.")

    walk(TrainConfig, "")
    return found


def _place_fields() -> list[str]:
    """The config's string fields that name a place (a path or URI), from the schema."""
    found = []

    def walk(model, prefix: str) -> None:
        for name, field in model.model_fields.items():
            if may_hold_credentials(model, name) and "str" in str(field.annotation):
                found.append(prefix + name)
            for arg in (field.annotation, *typing.get_args(field.annotation)):
                if hasattr(arg, "model_fields"):
                    walk(arg, f"{prefix}{name}.")

    walk(TrainConfig, "")
    return found


MAPPINGS = _mapping_fields()
PLACES = _place_fields()
BASE = {"batch": {"global_batch_size": 8}, "tracking": {"enabled": False}}


def _config(path: str, value) -> TrainConfig:
    data = json.loads(json.dumps(BASE))
    if path.startswith("model.kwargs"):
        data["model"] = {"name": "factory", "factory": "pkg.mod:build"}
    if path.startswith("model.hf"):
        data["model"] = {"name": "hf"}
        if isinstance(value, dict):
            value = {"model_type": "llama", **value}
    node = data
    *head, last = path.split(".")
    for part in head:
        node = node.setdefault(part, {})
    node[last] = value
    return TrainConfig.from_dict(data)


def sinks(cfg: TrainConfig, tmp_path: Path, override: str) -> dict[str, str]:
    """What every sink writes of a run of `cfg` (started with `override`)."""
    from rayacc.checkpoint import write_checkpoint
    from rayacc.data.sources import DatasetInfo
    from rayacc.driver.jobs import job_command
    from rayacc.driver.runs import RunLocation
    from rayacc.run.quantities import run_identity
    from rayacc.tracking.mlflow_sink import param_items
    from rayacc.tracking.params import contract_params

    info = DatasetInfo(path="x.parquet", format="classification", num_rows=64, num_features=4,
                       num_classes=2)  # fmt: skip
    identity = run_identity(cfg, info)
    folder = write_checkpoint(
        tmp_path / "ck",
        state={},
        description={"config": cfg.model_dump(mode="json"), "dataset": {}},
        meta={"identity": identity},
    )
    RunLocation(str(tmp_path / "runs"), "r").record(overrides=[override], identity=identity)
    out = io.StringIO()
    stream = RedactingStream(out)
    stream.write(cfg.to_yaml())
    key = override.split("=", 1)[0]
    stream.write(f"  changed on resume: {key}: old → {SECRET}\n")
    for piece in (f"a library says {SECRET[:5]}", f"{SECRET[5:]} and goes on\n"):
        stream.write(piece)
    stream.release()
    params = contract_params(cfg, cfg.batch_split(1), 0.1)
    return {
        "console": out.getvalue(),
        "MLflow params": json.dumps(param_items(params)),
        "MLflow config artifact": redact(cfg.to_yaml()),
        "checkpoint model.json": (folder / "model.json").read_text(),
        "checkpoint meta.json": (folder / "meta.json").read_text(),
        "run info": (tmp_path / "runs" / "r" / "rayacc_run.json").read_text(),
        "job entrypoint": job_command(Path("jobs/x.yaml"), [override])[0],
    }


def test_the_schema_has_the_fields_the_cases_come_from():
    assert {"model.kwargs", "model.hf.config"} <= set(MAPPINGS)
    assert {"tracking.tracking_uri", "data.source", "run.storage_path"} <= set(PLACES)
    assert len(KEYS) >= 5 * len(SECRET_WORDS) - 10


@pytest.mark.parametrize("field", MAPPINGS)
@pytest.mark.parametrize("key", KEYS)
def test_a_value_under_a_secret_named_key_at_any_depth_is_masked_in_every_sink(
    tmp_path, field, key
):
    nested = {"inner": {key: SECRET}, "n": 3}
    cfg = _config(field, nested)
    register_config(cfg)
    assert SECRET in KNOWN, key
    for sink, text in sinks(cfg, tmp_path, f"{field}.inner.{key}={SECRET}").items():
        assert SECRET not in text and SECRET[:10] not in text, (field, key, sink)


@pytest.mark.parametrize("field", PLACES)
def test_a_uris_userinfo_in_any_place_field_is_masked_in_every_sink(tmp_path, field):
    uri = f"s3://svc:{SECRET}@bucket/data"
    cfg = _config(field, uri)
    register_config(cfg)
    assert SECRET in KNOWN
    for sink, text in sinks(cfg, tmp_path, f"{field}={uri}").items():
        assert SECRET not in text, (field, sink)


@pytest.mark.parametrize("variable", CREDENTIAL_VARIABLES)
def test_every_credential_variable_is_masked_in_every_sink(tmp_path, variable):
    register_environment({variable: SECRET, "PATH": "/usr/bin"})
    assert SECRET in KNOWN and "/usr/bin" not in KNOWN
    cfg = _config("model.kwargs", {"note": "x"})
    for sink, text in sinks(cfg, tmp_path, f"model.kwargs.note={SECRET}").items():
        assert SECRET not in text, (variable, sink)


def test_a_variable_named_like_a_secret_and_a_credentials_file_are_registered(tmp_path):
    key_file = tmp_path / "sa.json"
    key_file.write_text(json.dumps({"type": "service_account", "private_key": "-----KEY" + SECRET,
                                    "private_key_id": "abcdef0123456789abcd"}))  # fmt: skip
    aws = tmp_path / "credentials"
    aws.write_text(
        f"[default]\naws_access_key_id = AKIAEXAMPLE\naws_secret_access_key = {SECRET}x\n"
    )
    register_environment({
        "MY_DB_PASSWORD": SECRET + "db",
        "GOOGLE_APPLICATION_CREDENTIALS": str(key_file),
        "AWS_SHARED_CREDENTIALS_FILE": str(aws),
        "MLFLOW_TRACKING_URI": f"https://u:{SECRET}uri@mlflow.example",
    })  # fmt: skip
    for value in (SECRET + "db", "-----KEY" + SECRET, SECRET + "x", SECRET + "uri"):
        assert value in KNOWN, value
        assert value not in redact(f"a library says {value}.")


def test_a_tokenizers_special_tokens_and_plain_values_are_not_secrets():
    cfg = _config("model.hf.config", {"model_type": "llama", "eos_token": "</s>",
                                      "pad_token": "<pad>", "hidden_size": 64})  # fmt: skip
    register_config(cfg)
    assert "</s>" not in KNOWN and "<pad>" not in KNOWN and "llama" not in KNOWN
    assert redact("generated text</s><pad>") == "generated text</s><pad>"


REVIEWED = [
    ("Driver={ODBC};Pwd={hunter2;secret};Uid=a", "hunter2", "secret"),
    ("password: [hunter2x]", "hunter2x", None),
    ("spring.datasource.password: hunter2x", "hunter2x", None),
    ("db:\n  password: |\n    hunter2-line\n  next: 1", "hunter2-line", None),
    ("password:\n  hunter2-next\n", "hunter2-next", None),
    ('{"log": "line\\nghp_' + "a1" * 18 + '"}', "ghp_" + "a1" * 18, None),
    ("x=%3Dghp_" + "b2" * 18, "ghp_" + "b2" * 18, None),
    ("key AIza" + "C3d" * 11 + "xy in the text", "AIza" + "C3d" * 11, None),
    ("Authorization: ya29." + "e4" * 15, "ya29." + "e4" * 15, None),
    ("curl -u admin:hunter2pw https://host/x", "hunter2pw", None),
    ("sshpass -p hunter2pw ssh host", "hunter2pw", None),
    ("mysql -uroot -phunter2pw db", "hunter2pw", None),
    # inside a name, after a separator (`tracking.run_name=nightly-ghp_…`)
    ("nightly-ghp_" + "c3" * 18, "ghp_" + "c3" * 18, None),
    ("runs/nightly_github_pat_" + "D4" * 12, "github_pat_" + "D4" * 12, None),
    ("ci.glpat-" + "e5F6" * 5, "glpat-" + "e5F6" * 5, None),
]
"""The reviewer's shapes of the second net: (text, the secret, another part of it)."""


@pytest.mark.parametrize(("text", "secret", "part"), REVIEWED, ids=[t[0][:30] for t in REVIEWED])
def test_the_reviewers_shapes_are_masked(text, secret, part):
    masked = redact(text)
    assert secret not in masked and (part is None or part not in masked), masked
    if text.startswith("mysql"):
        assert masked.endswith(" db"), "the database name is not the password"


def _stream(pieces) -> tuple[str, str]:
    out = io.StringIO()
    stream = RedactingStream(out)
    for piece in pieces:
        stream.write(piece)
    before = out.getvalue()
    stream.release()
    return before, out.getvalue()


def test_a_certificate_line_holds_nothing_back_and_no_line_is_lost():
    lines = ["rayacc: the server's -----BEGIN CERTIFICATE----- MIIC…\n"]
    lines += [f"step {i}/3000  loss 2.{i:04d}\n" for i in range(1, 3001)] + ["done\n"]
    before, after = _stream(lines)
    assert before == after == "".join(lines), "every line out as it was written, at once"


def test_a_private_key_across_writes_is_masked_and_the_stream_goes_on():
    pieces = ["-----BEGIN RSA PRIV", "ATE KEY-----\nMIIEsecret1\n", "MIIEsecret2\n-----END RSA ",
              "PRIVATE KEY-----\nafter the key\n"]  # fmt: skip
    before, after = _stream(pieces)
    assert "secret1" not in after and "secret2" not in after and after.endswith("after the key\n")
    assert before == after


def test_a_long_line_in_pieces_is_read_in_linear_time_and_leaks_nothing():
    KNOWN.add(SECRET)
    unit = f"{'x' * 100} password=hunter2secret and {SECRET} "
    line = unit * (1_200_000 // len(unit))
    pieces = [line[i : i + 4096] for i in range(0, len(line), 4096)] + ["\n"]
    t0 = time.process_time()
    before, after = _stream(pieces)
    spent = time.process_time() - t0
    assert spent < 2.0, spent
    assert "hunter2secret" not in after and SECRET not in after
    held = len(after) - len(before)
    assert held <= 2 * RedactingStream.WINDOW, f"{held} characters held to the line's end"


CONSOLE = [
    "rayacc train jobs/digits.yaml\n",
    "  global batch 256 = micro 32 × accum 4 × workers 2\n",
    "  effective LR 0.006 = 0.003 × linear(256/128)\n",
    "  strategy DDP (the whole model on every rank); precision fp32\n",
    "  MLflow: sqlite:///tmp/mlflow.db, experiment 'rayacc' (tracking.tracking_uri)\n",
    "step 100/300  1:02 elapsed  ETA 2:05  loss 2.1043  lr 0.000854  78 samples/s\n",
    "  checkpoint: /tmp/rr/runs/nl/checkpoint_step00000004\n",
    "  changed on resume: train.max_steps: 4 → 6\n",
    "  - train.loss_chunk_token: unknown key. Fix: did you mean train.loss_chunk_tokens?\n",
    "  goodput 2.8%: training 0.5 s of 17.3 s (start-up 2.4 s, Ray start 13.5 s)\n",
]


def test_rayaccs_own_console_lines_are_left_as_they_are():
    register_environment({"HF_TOKEN": SECRET})
    register_config(_config("model.kwargs", {"hub_token": SECRET + "2"}))
    before, after = _stream(CONSOLE)
    assert before == after == "".join(CONSOLE)
    assert [redact(line) for line in CONSOLE] == CONSOLE


def test_variables_named_like_a_secret_that_hold_none_are_not_registered():
    """The shell's working directories (`PWD`: `pwd` is a secret word): registered, every path
    under the working directory would be masked (a plan file's job path read back as `***`)."""
    register_environment({"PWD": "/tmp/work/project", "OLDPWD": "/tmp/work/before"})
    assert len(KNOWN) == 0
    assert (
        redact("job: /tmp/work/project/jobs/digits.yaml")
        == "job: /tmp/work/project/jobs/digits.yaml"
    )


def test_a_sweeps_grid_over_a_secret_named_key_reaches_no_record(tmp_path):
    """The parent run's `sweep.yaml` artifact held both values of a grid over
    `model.kwargs.hub_token` in clear (its params were masked): the sweep file's secrets are
    known by where they stand once it is read, so every record of it masks them."""
    import yaml
    from mlflow.tracking import MlflowClient

    from rayacc.config.sweep import SweepConfig
    from rayacc.driver.sweep import _open_parent, expand_trials

    values = ["plain-grid-secret-one", "plain-grid-secret-two"]  # no token shape: by origin
    text = yaml.safe_dump({
        "name": "secret-grid",
        "config": {"model": {"name": "factory", "factory":
                             "tests.support.models.planted_factory:build"},
                   "batch": {"global_batch_size": 8, "micro_batch_size": 4},
                   "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}},
        "grid": {"model.kwargs.hub_token": values},
    })  # fmt: skip
    (tmp_path / "sweep.yaml").write_text(text)
    sweep, base, _ = SweepConfig.from_yaml(tmp_path / "sweep.yaml")
    uri = base["tracking"]["tracking_uri"]
    parent = _open_parent(sweep, expand_trials(sweep, base), uri, "sweeps", "secret-grid", text)
    parent.finish()
    client = MlflowClient(uri)
    artifact = client.download_artifacts(parent.run_id, "sweep.yaml", str(tmp_path / "got"))
    records = [Path(artifact).read_text(), repr(client.get_run(parent.run_id).data.params)]
    for record in records:
        assert not any(v in record for v in values), record
