import pytest

from rayacc.config import ConfigError, TrainConfig
from rayacc.config.loader import NOT_YAML

GOOD = {
    "batch": {"global_batch_size": 256, "micro_batch_size": 32},
    "scaling": {"num_workers": 2},
}


def load(data, overrides=None):
    return TrainConfig.from_dict(data, overrides)


def errors_of(data, overrides=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(data, overrides)
    return info.value


def with_(section, **values):
    data = {k: dict(v) for k, v in GOOD.items()}
    data.setdefault(section, {}).update(values)
    return data


def test_fsdp_takes_compile_and_auto_micro_batch():
    cfg = load(
        {
            **with_("train", strategy="fsdp", compile=True, precision="bf16"),
            "batch": {
                "global_batch_size": 256,
                "micro_batch_size": "auto",
                "memory_budget_mb": 512,
            },
        }
    )
    assert cfg.train.compile and cfg.batch.auto_micro_batch


def test_deepspeed_takes_bf16_and_fp16_on_gpus():
    for precision, gpu in (("bf16", False), ("fp16", True)):
        cfg = load(
            {
                **with_("train", strategy="deepspeed", precision=precision),
                "scaling": {"num_workers": 2, "use_gpu": gpu},
                "deepspeed": {"stage": 3},
            }
        )
        assert cfg.train.precision == precision


def test_hsdp_and_offload_under_fsdp():
    for replicate in (1, 2, "auto"):
        cfg = load(
            {
                **with_("train", strategy="fsdp"),
                "fsdp": {"replicate": replicate, "offload": "cpu"},
            }
        )
        assert (cfg.fsdp.replicate, cfg.fsdp.offload) == (replicate, "cpu")
    elastic = {"fsdp": {"replicate": "auto"}, "scaling": {"num_workers": [2, 4]}}
    cfg = load({**with_("train", strategy="fsdp"), **elastic})
    assert cfg.fsdp.replicate == "auto"


def test_an_elastic_deepspeed_group_under_adamw():
    # a resize goes through DeepSpeed's universal checkpoint, which carries Adam's state
    cfg = load({**with_("train", strategy="deepspeed"), "scaling": {"num_workers": [1, 2]}})
    assert cfg.scaling.elastic and cfg.optim.name == "adamw"


def test_good_config_and_defaults():
    cfg = load(GOOD)
    assert cfg.batch.global_batch_size == 256
    assert cfg.optim.lr_scaling == "linear"
    assert cfg.train.precision == "fp32"
    flat = cfg.flat()
    assert flat["batch.micro_batch_size"] == 32 and flat["optim.name"] == "adamw"


BAD = [
    # (data, field path the error must name, a word of the fix or message)
    (with_("batch", micro_batch_size=-4), "batch.micro_batch_size", ">= 1"),
    (with_("batch", micro_batch_size=30), "batch.micro_batch_size", "32"),
    (with_("batch", grad_accum_steps=3), "batch.global_batch_size", "it would be 4"),
    # 3 workers take uneven shares of 256 (86 + 85 + 85); a fixed accumulation cannot
    (
        {
            **with_("scaling", num_workers=3),
            "batch": {"global_batch_size": 256, "grad_accum_steps": 2},
        },
        "batch.global_batch_size",
        "scaling.num_workers=3",
    ),
    (with_("scaling", num_workers=0), "scaling.num_workers", "set a value >= 1"),
    (with_("scaling", num_workers=[4, 2]), "scaling.num_workers", "1 <= min <= max"),
    (
        with_("scaling", on_resize="keep_micro_batch"),
        "scaling.on_resize",
        "only applies to elastic",
    ),
    (with_("optim", lr=0), "optim.lr", "> 0"),
    (with_("optim", lr_scaling="cubic"), "optim.lr_scaling", "'linear', 'sqrt' or 'none'"),
    (with_("optim", name="lamb"), "optim.name", "'adamw', 'adam' or 'sgd'"),
    (with_("optim", max_grad_norm=-1.0), "optim.max_grad_norm", "> 0"),
    (with_("train", precision="fp8"), "train.precision", "'fp32', 'bf16' or 'fp16'"),
    (with_("train", max_steps="ten"), "train.max_steps", "whole number"),
    (with_("data", val_fraction=1.5), "data.val_fraction", "< 1"),
    (with_("data", shuffle="sometimes"), "data.shuffle", "true or false"),
    (with_("model", n_head=3), "model.n_head", "n_embd"),
    (with_("model", name="factory"), "model.factory", "package.module:function"),
    (
        with_("model", name="factory", factory="mypkg.build"),
        "model.factory",
        "package.module:function",
    ),
    (with_("model", factory="mypkg:build"), "model.factory", "set model.name=factory"),
    (with_("model", name="gpt", block_size=64), "data.seq_len", "block_size"),
    (with_("optim", warmup_step=10), "optim.warmup_step", "optim.warmup_steps"),
    ({**GOOD, "trian": {}}, "trian", "'train'"),
    ({**GOOD, "seed": "abc"}, "seed", "whole number"),
    (with_("train", strategy="fsdp", precision="fp16"), "train.precision", "bf16"),
    (with_("train", strategy="zero"), "train.strategy", "'ddp', 'fsdp' or 'deepspeed'"),
    # what DeepSpeed does not run (each with the fix)
    (
        {**with_("train", strategy="deepspeed", precision="fp16")},
        "train.precision",
        "train.precision=bf16",
    ),
    (
        {**with_("train", strategy="deepspeed"), "deepspeed": {"offload_params": "cpu"}},
        "deepspeed.offload_params",
        "deepspeed.stage=3",
    ),
    ({**with_("train", strategy="deepspeed", compile=True)}, "train.compile", "compile=false"),
    (
        {
            **with_("train", strategy="deepspeed"),
            "batch": {"global_batch_size": 256, "micro_batch_size": "auto"},
        },
        "batch.micro_batch_size",
        "a number",
    ),
    # HSDP's replica groups and FSDP's offload
    ({"fsdp": {"replicate": 2}}, "fsdp.replicate", "train.strategy=fsdp"),
    (
        {**with_("train", strategy="deepspeed"), "fsdp": {"offload": "cpu"}},
        "fsdp.offload",
        "train.strategy=fsdp",
    ),
    ({**with_("train", strategy="fsdp"), "fsdp": {"replicate": 3}}, "fsdp.replicate", "divisor"),
    ({**with_("train", strategy="fsdp"), "fsdp": {"replicate": 0}}, "fsdp.replicate", ">= 1"),
    (
        {
            **with_("train", strategy="fsdp"),
            "fsdp": {"replicate": 2},
            "scaling": {"num_workers": [2, 4]},
        },
        "fsdp.replicate",
        "fsdp.replicate=auto",
    ),
    (
        {
            **with_("train", strategy="deepspeed"),
            "optim": {"name": "sgd"},
            "scaling": {"num_workers": [1, 2]},
        },
        "scaling.num_workers",
        "optim.name=adamw",
    ),
]


@pytest.mark.parametrize(
    ("data", "path", "hint"), BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)]
)
def test_bad_config_names_the_field_and_fix(data, path, hint):
    err = errors_of(data)
    assert path in err.paths, str(err)
    line = next(str(i) for i in err.issues if i.path == path)
    assert hint in line, line


def test_all_errors_are_reported_at_once():
    data = {
        "batch": {"global_batch_size": 250, "micro_batch_size": 32},
        "optim": {"lr": -1, "lr_scaling": "lin"},
        "train": {"precision": "fp8"},
        "modle": {},
    }
    err = errors_of(data)
    assert set(err.paths) == {
        "batch.micro_batch_size",
        "optim.lr",
        "optim.lr_scaling",
        "train.precision",
        "modle",
    }
    assert "5 problems" in str(err)
    assert "did you mean 'model'" in str(err)


def test_value_in_message():
    err = errors_of(with_("optim", lr=-0.5))
    assert "(got -0.5)" in str(err)


def test_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "batch:\n  global_batch_size: 256\n  micro_batch_size: 32\noptim:\n  lr: 0.01\n"
    )
    cfg = TrainConfig.from_yaml(
        path,
        overrides=[
            "batch.micro_batch_size=8",
            "optim.max_grad_norm=null",
            "train.precision=bf16",
            "data.shuffle=false",
        ],
    )
    assert cfg.batch.micro_batch_size == 8
    assert cfg.optim.max_grad_norm is None
    assert cfg.train.precision == "bf16"
    assert cfg.data.shuffle is False
    assert cfg.optim.lr == 0.01


def test_override_errors(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("batch:\n  global_batch_size: 256\n  micro_batch_size: 32\n")
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_yaml(
            path, overrides=["batch.micro_batch_size", "batch.micro_bach_size=4", "seed.x=1"]
        )
    text = str(info.value)
    assert "key.path=value" in text
    assert "batch.micro_bach_size: unknown key" in text and "batch.micro_batch_size" in text
    assert "seed: is a value, not a section" in text
    assert str(path) in text


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        TrainConfig.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        TrainConfig.from_yaml(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        TrainConfig.from_yaml(lst)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_yaml_round_trip():
    cfg = load(GOOD)
    again = TrainConfig.from_dict(__import__("yaml").safe_load(cfg.to_yaml()))
    assert again == cfg


def test_auto_micro_batch_rules_name_their_fields():
    cfg = TrainConfig.from_dict(
        {"batch": {"global_batch_size": 64, "micro_batch_size": "auto", "memory_budget_mb": 512}}
    )
    assert cfg.batch.auto_micro_batch and cfg.batch.fixed_micro_batch_size is None
    # the plan known before the search: accumulation 1, the largest micro-batch it may pick
    assert (cfg.batch_split().micro_batch_size, cfg.batch_split().grad_accum_steps) == (32, 1)
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({"batch": {"micro_batch_size": "auto", "grad_accum_steps": 2}})
    text = str(err.value)
    for field in ("batch.global_batch_size", "batch.grad_accum_steps", "batch.memory_budget_mb"):
        assert field in text, text
    gpu = {"global_batch_size": 64, "micro_batch_size": "auto"}
    assert TrainConfig.from_dict({"batch": gpu, "scaling": {"use_gpu": True}}).batch.memory_budget


def test_a_value_no_union_branch_takes_is_one_problem():
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({"batch": {"global_batch_size": 8, "micro_batch_size": "big"}})
    assert len(err.value.issues) == 1
    text = str(err.value)
    assert "batch.micro_batch_size: is not a valid value (got 'big')" in text
    assert "whole number" in text and "'auto'" in text


TIMEOUT = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


@pytest.mark.parametrize(
    "scaling, timeout",
    [
        # an elastic run goes smaller within seconds after a node is lost without notice
        ({"num_workers": [1, 2]}, "10"),
        # a fixed size only waits for capacity: Ray's own 60 s
        ({"num_workers": 2}, None),
        ({"num_workers": 2, "start_timeout_s": 30}, "30"),
        ({"num_workers": [1, 2], "start_timeout_s": 2.5}, "2.5"),
    ],
)
def test_the_placement_timeout_the_run_hands_ray_train(scaling, timeout):
    cfg = load({**GOOD, "scaling": scaling})
    assert cfg.scaling.ray_train_env() == ({TIMEOUT: timeout} if timeout else {})


@pytest.mark.parametrize("suffix", sorted(NOT_YAML))
def test_a_job_file_of_another_format_is_named_as_such(tmp_path, suffix):
    # valid YAML inside: the format is judged by what the file says it is
    path = tmp_path / f"job{suffix}"
    path.write_text("batch: {global_batch_size: 32}\n")
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_yaml(path)
    assert f"a {NOT_YAML[suffix]} file, not YAML" in str(info.value), str(info.value)
    assert str(path) in str(info.value)
