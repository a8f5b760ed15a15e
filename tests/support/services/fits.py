"""Whole-stack fits for the Ray tests: a small config, a fit with a deadline, the weights and
the single-process references they are compared with."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from rayacc import TrainConfig, build_model, fit
from rayacc.data.bundled import prepare_bundled

FIT_TIMEOUT_S = 300


def fit_or_fail(cfg: TrainConfig, resume: bool = False, observers=()):
    """fit() with a deadline: a DDP hang fails the test instead of stalling the suite."""
    box: dict = {}

    def run():
        try:
            box["result"] = fit(cfg, resume=resume, observers=observers)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(FIT_TIMEOUT_S)
    if t.is_alive():
        pytest.fail(f"fit did not finish in {FIT_TIMEOUT_S} s (hung workers?)")
    if "error" in box:
        raise box["error"]
    return box["result"]


def digits_subset(path, n: int):
    table = pq.read_table(prepare_bundled("digits")).slice(0, n)
    pq.write_table(table, path)
    return str(path)


def config(tmp_path, **sections) -> TrainConfig:
    base = {
        "seed": 3,
        "model": {"name": "mlp", "hidden_sizes": [32]},
        "data": {"source": "digits", "val_fraction": 0.0},
        "batch": {"global_batch_size": 32, "micro_batch_size": 4},
        "optim": {"name": "sgd", "lr": 0.1, "schedule": "constant"},
        "train": {"max_steps": 1},
        "scaling": {"num_workers": 2, "cpus_per_worker": 0.5},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "tests"},
        "run": {"storage_path": str(tmp_path / "runs")},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            base.setdefault(name, {}).update(values)
        else:
            base[name] = values
    return TrainConfig.from_dict(base)


def weights(model: torch.nn.Module) -> torch.Tensor:
    """Every tensor of the model's state (a module's extra state, if any, is not one)."""
    state = model.state_dict().values()
    return torch.cat([p.detach().reshape(-1).double() for p in state if torch.is_tensor(p)])


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def sgd_step_errors(
    cfg: TrainConfig, full_batch_loss, trained_model, momentum: float = 0.0
) -> tuple[float, float]:
    """Distance of the trained weights, and of plain fp32 full-batch SGD (lr 0.1), from the
    float64 full-batch step, each relative to the size of that step. `full_batch_loss`: the
    loss of the whole window, or a list of them, one SGD step each (torch's SGD with
    `momentum`).

    fp32 weights round at ~1e-7 of their size, ~1e-6 of a small update: the fair bar for the
    pipeline is plain fp32 full-batch training's own distance from the float64 step.
    """

    windows = full_batch_loss if isinstance(full_batch_loss, list) else [full_batch_loss]

    def step(dtype):
        ref = build_model(cfg).to(dtype)
        before = weights(ref)
        velocity: dict[torch.nn.Parameter, torch.Tensor] = {}
        for window_loss in windows:
            ref.zero_grad()
            window_loss(ref, dtype).backward()
            with torch.no_grad():
                for p in ref.parameters():
                    if p.grad is None:  # frozen (a base under adapters)
                        continue
                    v = velocity.get(p)
                    velocity[p] = p.grad.clone() if v is None else momentum * v + p.grad
                    p -= 0.1 * velocity[p]
        return before, weights(ref)

    before, exact = step(torch.float64)
    _, plain_fp32 = step(torch.float32)
    scale = (exact - before).norm()
    trained = weights(trained_model)
    return float((trained - exact).norm() / scale), float((plain_fp32 - exact).norm() / scale)


def padded_token_rows(path, seed: int, dtype) -> list[list[int]]:
    """16 token sequences of 2 to 20 tokens written to `path`, short ones first (the first
    rank's half of a window then has far fewer tokens); returns them."""
    rng = np.random.default_rng(seed)
    seqs = sorted((rng.integers(0, 17, rng.integers(2, 21)).tolist() for _ in range(16)), key=len)
    pq.write_table(pa.table({"tokens": pa.array(seqs, pa.list_(dtype))}), path)
    return seqs


def padded_token_loss(seqs, masks=None):
    """The full-batch loss of `seqs` in one process: the mean over every target token (with
    `masks`, every target token its mask counts)."""
    from rayacc.data.rows import LocalRows
    from rayacc.engine import IGNORE_INDEX

    lists = [np.asarray(s) for s in seqs]
    held = None if masks is None else [np.asarray(m) for m in masks]
    rows = LocalRows("tokens", token_lists=lists, mask_lists=held)

    def loss(model, dtype):
        batch = rows.take(np.arange(len(seqs)))
        logits = model(batch["input"])
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            batch["target"].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )

    return loss
