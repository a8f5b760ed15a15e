"""DeepSpeed's config as rayacc writes it (engine/parallel/deepspeed.py): the job's batch,
clipping, precision and window over the user's file, whose own keys are kept; a file that sets
the job's keys otherwise is refused naming both values. Pure: DeepSpeed is not imported."""

from __future__ import annotations

import pytest

from rayacc.engine.parallel import DeepSpeedConfigError, deepspeed_config

JOB = dict(
    stage=3,
    offload_optimizer="cpu",
    offload_params="none",
    micro_batch_size=4,
    grad_accum_steps=8,
    num_workers=2,
    max_grad_norm=None,
    precision="fp32",
)


def test_the_job_owns_the_batch_the_window_and_clipping():
    merged = deepspeed_config(
        **JOB, user={"zero_optimization": {"overlap_comm": True}, "steps_per_print": 10}
    )
    assert merged["train_micro_batch_size_per_gpu"] == 4
    assert merged["gradient_accumulation_steps"] == 8
    assert merged["train_batch_size"] == 64
    # DeepSpeed's default clipping is 1.0: off must be written as 0
    assert merged["gradient_clipping"] == 0.0
    assert merged["managed_gradient_accumulation"] is False
    zero = merged["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu"}
    assert zero["overlap_comm"] is True, "the user's own keys are kept"
    assert merged["bf16"] == {"enabled": False} and merged["fp16"] == {"enabled": False}
    assert deepspeed_config(**{**JOB, "max_grad_norm": 0.5})["gradient_clipping"] == 0.5


@pytest.mark.parametrize(
    ("user", "named"),
    [
        ({"train_batch_size": 128}, "train_batch_size=128, the job 64"),
        ({"train_micro_batch_size_per_gpu": 2}, "train_micro_batch_size_per_gpu=2, the job 4"),
        ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps=1, the job 8"),
        ({"gradient_clipping": 1.0}, "gradient_clipping=1.0, the job 0.0"),
        ({"optimizer": {"type": "AdamW"}}, "sets 'optimizer'"),
        ({"scheduler": {"type": "WarmupLR"}}, "sets 'scheduler'"),
        ({"bf16": {"enabled": True}}, "bf16.enabled=true, the job's train.precision is 'fp32'"),
        ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage=2, the job 3"),
    ],
)
def test_a_file_that_disagrees_with_the_job_is_refused_naming_both(user, named):
    with pytest.raises(DeepSpeedConfigError) as caught:
        deepspeed_config(**JOB, user=user, source="deepspeed.config='ds.json'")
    assert named in str(caught.value) and "ds.json" in str(caught.value)
    assert "Fix:" in str(caught.value)


def test_agreeing_keys_are_not_conflicts():
    same = {"train_batch_size": 64, "gradient_clipping": 0, "fp16": {"enabled": False}}
    assert deepspeed_config(**JOB, user=same)["train_batch_size"] == 64


HF_STYLE = {
    # as Hugging Face's DeepSpeed integration writes a ZeRO-3 config
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def test_a_hugging_face_style_config_is_filled_in_where_the_job_owns_the_value():
    merged = deepspeed_config(**{**JOB, "max_grad_norm": 1.0}, user=HF_STYLE)
    assert merged["train_micro_batch_size_per_gpu"] == 4
    assert merged["gradient_accumulation_steps"] == 8 and merged["train_batch_size"] == 64
    assert merged["gradient_clipping"] == 1.0
    assert merged["fp16"] == {"enabled": False} and merged["bf16"] == {"enabled": False}
    zero = merged["zero_optimization"]
    # the offload the job asks for, with the file's own keys of it kept
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["overlap_comm"] is True and zero["stage3_param_persistence_threshold"] == 0
    # sizes the integration derives from the model: DeepSpeed's own defaults
    assert "reduce_bucket_size" not in zero and "stage3_prefetch_bucket_size" not in zero
    assert "auto" not in str(merged)
    assert HF_STYLE["gradient_clipping"] == "auto", "the user's mapping is not changed"


@pytest.mark.parametrize(
    ("user", "named"),
    [
        (
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            'zero_optimization.offload_optimizer.device="nvme", the job "cpu" '
            "(deepspeed.offload_optimizer)",
        ),
        (
            {"zero_optimization": {"offload_param": {"device": "cpu"}}},
            "Fix: set deepspeed.offload_params=cpu",
        ),
        ({"optimizer_x": {"lr": "auto"}}, 'optimizer_x.lr="auto", which rayacc does not fill in'),
        # a derived value's fix names the fields that are set, and JSON's values
        (
            {"gradient_accumulation_steps": 2},
            "(batch.global_batch_size and batch.micro_batch_size (accumulation is derived",
        ),
        ({"fp16": {"enabled": True}}, "fp16.enabled=true"),
    ],
)
def test_what_disagrees_or_cannot_be_filled_in_is_refused_with_settable_fields(user, named):
    with pytest.raises(DeepSpeedConfigError) as caught:
        deepspeed_config(**JOB, user=user, source="deepspeed.config='ds.json'")
    said = str(caught.value)
    assert named in said and "Fix:" in said and "True" not in said, said


def _paths(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in d.items():
        where = f"{prefix}.{key}" if prefix else key
        out += _paths(value, where) if isinstance(value, dict) else [(where, value)]
    return out


def _nested(path: str, value: object) -> dict:
    head, _, rest = path.partition(".")
    return {head: _nested(rest, value) if rest else value}


def _at(d: dict, path: str) -> object:
    for key in path.split("."):
        d = d[key]
    return d


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_key_rayacc_only_defaults_is_the_users_when_the_file_sets_it(stage):
    """Every value rayacc writes where DeepSpeed's default differs (generated from
    `rayacc_defaults`): the user's file wins, never replaced without a word."""
    from rayacc.engine.parallel.deepspeed_config import rayacc_defaults

    job = {**JOB, "stage": stage, "offload_optimizer": "none"}
    defaults = _paths(rayacc_defaults(stage))
    assert defaults, "rayacc writes defaults"
    for path, ours in defaults:
        theirs = (not ours) if isinstance(ours, bool) else (ours or 0) + 12345
        merged = deepspeed_config(**job, user=_nested(path, theirs))
        assert _at(merged, path) == theirs, (path, _at(merged, path))
        # without the key in the file, rayacc's value
        assert _at(deepspeed_config(**job), path) == ours, path


def test_the_users_keys_the_review_found_replaced_are_kept():
    user = {
        "zero_optimization": {"stage3_param_persistence_threshold": 100000},
        "wall_clock_breakdown": True,
        "steps_per_print": 10,
        "zero_force_ds_cpu_optimizer": True,
    }
    merged = deepspeed_config(**{**JOB, "offload_optimizer": "none"}, user=user)
    assert merged["zero_optimization"]["stage3_param_persistence_threshold"] == 100000
    assert merged["wall_clock_breakdown"] is True and merged["steps_per_print"] == 10
    assert merged["zero_force_ds_cpu_optimizer"] is True


@pytest.mark.parametrize("key", ["managed_gradient_accumulation", "zero_allow_untested_optimizer"])
def test_a_key_the_job_must_own_is_refused_naming_it_and_why(key):
    from rayacc.engine.parallel.deepspeed_config import RUN_BY_RAYACC

    value, why = RUN_BY_RAYACC[key]
    with pytest.raises(DeepSpeedConfigError) as caught:
        deepspeed_config(**JOB, user={key: not value}, source="deepspeed.config='ds.json'")
    said = str(caught.value)
    assert f"sets {key}={str(not value).lower()}" in said and why in said and "Fix:" in said
    assert deepspeed_config(**JOB, user={key: value})[key] == value


def test_forcing_deepspeeds_cpu_adam_with_rayaccs_optimizer_offloaded_is_refused():
    with pytest.raises(DeepSpeedConfigError) as caught:
        deepspeed_config(**JOB, user={"zero_force_ds_cpu_optimizer": True})
    assert "zero_force_ds_cpu_optimizer=true" in str(caught.value)
    assert "deepspeed.offload_optimizer=none" in str(caught.value)
