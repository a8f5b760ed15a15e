"""`rayacc verify`: one optimizer step of the configured workers / micro / accum / precision
against the same global batch in one process, from the same initial weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rayacc.checkpoint.reader import load_model
from rayacc.config import TrainConfig
from rayacc.config.batch_split import BatchSplit
from rayacc.data.rows import read_rows
from rayacc.driver.fit import fit
from rayacc.driver.prelaunch import Prepared, prepare
from rayacc.engine.parallel import DDP
from rayacc.optim import build_schedule
from rayacc.rank.build import build_rank
from rayacc.redact import redact

__all__ = [
    "TOLERANCE",
    "TensorDiff",
    "VerifyResult",
    "compare",
    "reference_step",
    "verify",
    "without_dropout",
]

TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}
"""Largest relative difference allowed (see TensorDiff.max_rel), by precision, unless the
one-process fp32 step's own rounding is larger (TensorDiff.floor)."""

FLOOR_FACTOR = 4.0
"""A distributed step sums in another order than the one-process step: a few times that
step's own rounding is rounding too."""


@dataclass(frozen=True)
class TensorDiff:
    name: str
    max_abs: float
    max_rel: float
    """‖w_distributed − w_exact‖ / ‖w_exact − w_initial‖ over the tensor: the difference from
    the one-process float64 step, relative to its update. Norm-wise, because Adam's first step
    turns rounding noise in near-zero gradients into element updates of up to lr."""
    floor: float = 0.0
    """The same measure for the one-process fp32 step: the rounding any fp32 step has."""

    def allowed(self, tolerance: float) -> float:
        return max(tolerance, FLOOR_FACTOR * self.floor)


@dataclass
class VerifyResult:
    passed: bool
    tolerance: float
    diffs: list[TensorDiff]
    mlflow_run_id: str | None
    tracking_uri: str | None
    warnings: list[str]
    split: BatchSplit
    """The batch split the step ran (the run's reference split)."""

    @property
    def worst(self) -> TensorDiff:
        """The tensor nearest its bound (or furthest past it)."""
        return max(self.diffs, key=lambda d: d.max_rel / d.allowed(self.tolerance))


def _probe_batch(cfg: TrainConfig, prep: Prepared) -> dict[str, torch.Tensor]:
    """The first global batch of epoch 0 in the data order, as one micro-batch."""
    order = prep.spec.order
    n = min(prep.split.global_batch_size, order.num_train_rows)
    return read_rows(prep.info, prep.groups, order.row_ids(0, np.arange(n)))


RANDOM_KEYS = ("dropout", "pdrop", "layerdrop")
"""Keys of a transformers config that set a train-mode random draw (`attention_dropout`,
`resid_pdrop`, `layerdrop`, ...): each rank draws other masks than the one process would."""


def without_dropout(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """The config verify compares: dropout off wherever the config sets it (a rank draws other
    masks than one process does, so no step could agree), and what was turned off, said."""
    m = cfg.model
    if m.name in ("mlp", "gpt") and m.dropout:
        note = f"model.dropout {m.dropout:g} → 0 for the comparison"
        return cfg.model_copy(update={"model": m.model_copy(update={"dropout": 0.0})}), [note]
    if m.name == "hf":
        from rayacc.models.hf import resolve_hf_config

        config = resolve_hf_config(m.hf.config, m.hf.weights)
        random = {
            k: v
            for k, v in config.items()
            if any(word in k for word in RANDOM_KEYS)
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and v > 0
        }
        if random:
            hf = m.hf.model_copy(update={"config": {**config, **dict.fromkeys(random, 0.0)}})
            said = ", ".join(f"{k} {v:g}" for k, v in sorted(random.items()))
            note = f"model.hf.config's {said} → 0 for the comparison"
            return cfg.model_copy(update={"model": m.model_copy(update={"hf": hf})}), [note]
    return cfg, []


def _refuse_dropout_it_cannot_turn_off(cfg: TrainConfig, prep: Prepared) -> None:
    """A factory's model with dropout modules: verify cannot know how to turn them off."""
    from torch import nn

    from rayacc.config.errors import ConfigError, ConfigIssue
    from rayacc.models import build_on_meta

    if cfg.model.name != "factory":
        return
    model = build_on_meta(cfg, prep.info)
    drops = [n for n, mod in model.named_modules() if isinstance(mod, nn.Dropout) and mod.p > 0]
    if drops:
        raise ConfigError(
            [
                ConfigIssue(
                    "model.factory",
                    f"the model draws dropout in training ({', '.join(drops[:3])}): each rank "
                    "draws other masks than one process, so verify cannot compare the step",
                    cfg.model.factory,
                    fix="build it with a dropout of 0 for verify (through model.kwargs)",
                )
            ]
        )


def verify(cfg: TrainConfig) -> VerifyResult:
    cfg, notes = without_dropout(cfg)
    prep = prepare(cfg)
    _refuse_dropout_it_cannot_turn_off(cfg, prep)
    probe = cfg.model_copy(
        update={
            "train": cfg.train.model_copy(update={"max_steps": 1, "epochs": 1}),
            "tracking": cfg.tracking.model_copy(
                update={"run_name": cfg.tracking.run_name or "verify"}
            ),
        }
    )
    result = fit(probe, prepared=prepare(probe), tags={"rayacc.verify": "probe"})
    # the job's own factory, if it names one: the user's code, not the checkpoint's word
    factory = cfg.model.factory if cfg.model.name == "factory" else None
    distributed = load_model(result.checkpoint_dir, factory=factory).state_dict()

    # the reference: one process, the whole batch as one micro-batch, fp32, eager, the plain
    # loss; built as a rank is
    reference = cfg.model_copy(
        update={
            "train": cfg.train.model_copy(
                update={
                    "strategy": DDP.name,  # one process: the plain module
                    "precision": "fp32",
                    "compile": False,
                    "activation_checkpointing": "none",
                    "loss_chunk_tokens": None,
                }
            )
        }
    )
    batch = [_probe_batch(cfg, prep)]
    initial, single = reference_step(reference, cfg, prep, batch, torch.float32)
    _, exact = reference_step(reference, cfg, prep, batch, torch.float64)
    diffs = compare(distributed, initial, single, exact)
    tol = TOLERANCE[cfg.train.precision]
    passed = all(d.max_rel <= d.allowed(tol) for d in diffs)
    warnings = [*notes, *prep.warnings]
    if result.mlflow_run_id:
        from rayacc.tracking.mlflow_sink import tag_run

        try:
            tag_run(result.tracking_uri, result.mlflow_run_id, "rayacc.verified",
                    "PASS" if passed else "FAIL")  # fmt: skip
        except Exception as exc:  # the verdict stands without its tag
            warnings.append(
                f"could not tag MLflow run {result.mlflow_run_id} rayacc.verified: "
                f"{redact(str(exc)).splitlines()[0][:200]}"
            )
    return VerifyResult(
        passed, tol, diffs, result.mlflow_run_id, result.tracking_uri, warnings, prep.split
    )


def compare(
    distributed: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    single: dict[str, torch.Tensor],
    exact: dict[str, torch.Tensor],
) -> list[TensorDiff]:
    """Each floating tensor of the distributed step and of the one-process fp32 step
    measured from the float64 step (`exact`), relative to its update."""
    diffs = []
    for name, want in exact.items():
        if not torch.is_floating_point(want):
            continue
        update = (want - initial[name].double()).norm().item()
        delta = distributed[name].double() - want
        floor = _relative((single[name].double() - want).norm().item(), update)
        err = _relative(delta.norm().item(), update)
        diffs.append(TensorDiff(name, delta.abs().max().item(), err, floor))
    return diffs


def reference_step(
    reference: TrainConfig,
    cfg: TrainConfig,
    prep: Prepared,
    micro_batches: list[dict[str, torch.Tensor]],
    dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(initial, stepped) weights of one step over `micro_batches` in one process, in `dtype`
    (float64: the exact step the others are measured from), built as a rank is."""
    parts = build_rank(reference, prep.info, torch.device("cpu"), prep.effective_lr)
    model, step, loss_fn, count = parts.model, parts.accumulate, parts.loss_fn, parts.count
    model.to(dtype)  # in place: the optimizer keeps its parameters
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # the training run's schedule object, laid out for the probe's single step
    build_schedule(
        cfg.optim,
        parts.optimizer,
        peak_lr=prep.effective_lr,
        reference_batch=prep.split.global_batch_size,
        total_steps=1,
    )
    cast = [{k: v.to(dtype) if v.is_floating_point() else v for k, v in mb.items()}
            for mb in micro_batches]  # fmt: skip
    step(cast, loss_fn, count)
    return initial, {k: v.detach() for k, v in model.state_dict().items()}


def _relative(gap: float, update: float) -> float:
    return gap / update if update > 0 else (0.0 if gap == 0 else float("inf"))
