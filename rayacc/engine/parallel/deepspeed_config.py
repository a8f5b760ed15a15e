"""DeepSpeed's config for a job: the user's `deepspeed.config` file under the keys the job owns
(the batch, the window, clipping, precision, ZeRO's stage and offload), `"auto"` filled in
where the job owns the value, as Hugging Face's configs write it; a key set otherwise than the
job is refused naming both values and why the job owns it. Every other key of the user's is
used as given, over rayacc's defaults (quiet logging, stage 3 sharding small parameters too).
Pure: DeepSpeed is not imported."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

__all__ = [
    "AUTO",
    "RUN_BY_RAYACC",
    "DeepSpeedConfigError",
    "deepspeed_config",
    "rayacc_defaults",
    "read_deepspeed_user",
]


class DeepSpeedConfigError(ValueError):
    """A user's DeepSpeed config that disagrees with the job (or that rayacc cannot run)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems

    def __reduce__(self):
        return (type(self), (self.problems,))


def deepspeed_config(
    *,
    stage: int,
    offload_optimizer: str,
    offload_params: str,
    micro_batch_size: int,
    grad_accum_steps: int,
    num_workers: int,
    max_grad_norm: float | None,
    precision: str,
    user: dict[str, Any] | None = None,
    source: str = "deepspeed.config",
) -> dict[str, Any]:
    """DeepSpeed's config for the job: the user's keys (`user`, read from `source`) with
    rayacc's over them. Raises DeepSpeedConfigError naming every key the user's file sets
    otherwise than the job."""
    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": offload_optimizer}
    if offload_params != "none":
        zero["offload_param"] = {"device": offload_params}
    ours: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * num_workers,
        "gradient_clipping": float(max_grad_norm or 0.0),
        "fp16": {"enabled": precision == "fp16"},
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": zero,
        **{key: value for key, (value, _) in RUN_BY_RAYACC.items()},
    }
    defaults = rayacc_defaults(stage)
    user = user or {}
    if not isinstance(user, dict):
        raise DeepSpeedConfigError([f"{source}: not a JSON object. Fix: give a JSON object"])
    user = copy.deepcopy(user)
    why = {
        "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
        "gradient_accumulation_steps": "batch.global_batch_size and batch.micro_batch_size "
        "(accumulation is derived from them)",
        "train_batch_size": "batch.global_batch_size",
        "gradient_clipping": "optim.max_grad_norm (null = 0, off)",
    }
    problems = []
    for key, field in why.items():
        if (
            key in user
            and user[key] != AUTO
            and user[key] != ours[key]
            and not (key == "gradient_clipping" and _same_number(user[key], ours[key]))
        ):
            problems.append(
                f"{source} sets {key}={_json(user[key])}, the job {_json(ours[key])} ({field}). "
                f'Fix: drop {key} from the file or write "auto" (rayacc fills it in), or set '
                f"{field} to match"
            )
    for key, (value, why_ours) in RUN_BY_RAYACC.items():
        if key in user and user[key] != value:
            problems.append(
                f"{source} sets {key}={_json(user[key])}: rayacc runs DeepSpeed with "
                f"{_json(value)} ({why_ours}). Fix: drop {key} from the file"
            )
    if user.get("zero_force_ds_cpu_optimizer") is True and offload_optimizer != "none":
        problems.append(
            f"{source} sets zero_force_ds_cpu_optimizer=true with the optimizer offloaded: "
            "DeepSpeed then takes only its own CPU Adam, and rayacc hands it the torch "
            "optimizer optim.name builds. Fix: drop the key (or set it false), or set "
            "deepspeed.offload_optimizer=none"
        )
    for key, field in (("optimizer", "optim"), ("scheduler", "optim's schedule")):
        if key in user:
            problems.append(
                f"{source} sets {key!r}: rayacc builds the {key} from the job ({field}). "
                f"Fix: drop {key!r} from the file and set the job's {field} keys"
            )
    for key in ("fp16", "bf16", "amp"):
        enabled = (user.get(key) or {}).get("enabled") if isinstance(user.get(key), dict) else None
        wanted = ours.get(key, {"enabled": False})["enabled"]
        if enabled is not None and enabled != AUTO and bool(enabled) != wanted:
            problems.append(
                f"{source} sets {key}.enabled={_json(enabled)}, the job's train.precision is "
                f'{precision!r}. Fix: drop {key!r} from the file (or write "auto") and set '
                "train.precision"
            )
    their_zero = user.get("zero_optimization") or {}
    if isinstance(their_zero, dict):
        if their_zero.get("stage", zero["stage"]) not in (zero["stage"], AUTO):
            problems.append(
                f"{source} sets zero_optimization.stage={_json(their_zero['stage'])}, the job "
                f"{zero['stage']} (deepspeed.stage). Fix: drop it from the file (or write "
                '"auto") and set deepspeed.stage'
            )
        for key, field in (
            ("offload_optimizer", "deepspeed.offload_optimizer"),
            ("offload_param", "deepspeed.offload_params"),
        ):
            problems += _offload_agrees(their_zero, zero, key, field, source)
        # the sizes Hugging Face's integration derives from the model: DeepSpeed's defaults
        for key in [k for k, v in their_zero.items() if v == AUTO and k not in zero]:
            del their_zero[key]
    left = _autos(user, owned=set(why) | {"fp16", "bf16", "amp", "zero_optimization"})
    problems += [
        f'{source} sets {path}="auto", which rayacc does not fill in (it fills the batch, '
        "clipping, precision and ZeRO's stage and offload). Fix: give a value or drop the key"
        for path in left
    ]
    if problems:
        raise DeepSpeedConfigError(problems)
    merged = _deep_merge(_deep_merge(defaults, user), ours)
    for key in ("fp16", "bf16", "amp"):  # an "auto" left where the job has no value: off
        if isinstance(merged.get(key), dict) and merged[key].get("enabled") == AUTO:
            merged[key]["enabled"] = False
    return merged


AUTO = "auto"
"""Hugging Face's DeepSpeed configs write it where the trainer fills the value in."""


def rayacc_defaults(stage: int) -> dict[str, Any]:
    """rayacc's values where DeepSpeed's defaults differ: the user's file overrides each."""
    defaults: dict[str, Any] = {
        # rayacc's optimizer (optim.name) steps offloaded state too: on the CPU it is torch's
        "zero_force_ds_cpu_optimizer": False,
        # rayacc prints its own progress and timings
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        # small parameters are sharded too: the strategy's memory is what the stage says
        defaults["zero_optimization"] = {"stage3_param_persistence_threshold": 0}
    return defaults


RUN_BY_RAYACC: dict[str, tuple[Any, str]] = {
    "managed_gradient_accumulation": (
        False,
        "rayacc owns the window: every engine.step() ends one, the loss divided by the "
        "window's global item count, a short last window exact",
    ),
    "zero_allow_untested_optimizer": (
        True,
        "rayacc hands DeepSpeed the torch optimizer optim.name builds, which DeepSpeed "
        "refuses without it",
    ),
}
"""Keys the job must own beyond the batch, clipping, precision and ZeRO's stage and offload:
a user's other value is refused, naming why."""


def _json(value: Any) -> str:
    return json.dumps(value)


def _deep_merge(theirs: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    out = dict(theirs)
    for key, value in ours.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _offload_agrees(
    their_zero: dict[str, Any], zero: dict[str, Any], key: str, field: str, source: str
) -> list[str]:
    """An offload section agrees when its device is the job's (its other keys, `pin_memory`
    say, are kept); "none" or no device is no offload."""
    if key not in their_zero:
        return []
    theirs = their_zero[key]
    device = theirs.get("device", "none") if isinstance(theirs, dict) else theirs
    wanted = zero.get(key, {}).get("device", "none")
    if device in (wanted, AUTO) or (device is None and wanted == "none"):
        if isinstance(theirs, dict) and device == AUTO:
            theirs["device"] = wanted
        if wanted == "none":
            del their_zero[key]
        return []
    return [
        f"{source} sets zero_optimization.{key}.device={_json(device)}, the job "
        f"{_json(wanted)} ({field}). Fix: set {field}={device if device else 'none'} in the "
        "job, or drop the device from the file (its other keys are kept)"
    ]


def _autos(config: Any, owned: set[str], path: str = "") -> list[str]:
    """The paths of "auto" values outside the keys rayacc fills in."""
    found = []
    if isinstance(config, dict):
        for key, value in config.items():
            where = f"{path}.{key}" if path else key
            if not path and key in owned:
                continue
            found += (
                _autos(value, owned, where)
                if isinstance(value, dict | list)
                else ([where] if value == AUTO else [])
            )
    elif isinstance(config, list):
        for i, value in enumerate(config):
            found += _autos(value, owned, f"{path}[{i}]")
    return found


def _same_number(a: Any, b: Any) -> bool:
    return isinstance(a, int | float) and not isinstance(a, bool) and math.isclose(a, b)


MAX_DEEPSPEED_CONFIG_BYTES = 1 << 20
"""A DeepSpeed config is a page of JSON: a larger file is not one."""


def read_deepspeed_user(path: str | None) -> dict[str, Any] | None:
    """The user's `deepspeed_config.json` (`deepspeed.config`), read by the one reader of the
    files a job names (`config.loader.read_yaml`: JSON is YAML); one that is not a JSON object
    is refused naming the file."""
    if path is None:
        return None
    from rayacc.config.loader import read_yaml

    where = "deepspeed.config=ds_config.json"
    doc = read_yaml(path, "DeepSpeed config", where, MAX_DEEPSPEED_CONFIG_BYTES)
    if not isinstance(doc, dict):
        raise DeepSpeedConfigError(
            [f"deepspeed.config={path!r}: not a JSON object. Fix: give DeepSpeed's JSON config"]
        )
    return doc
