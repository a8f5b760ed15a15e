"""Fine-tuning on gloo ranks (no Ray), built as a worker builds it (`build_rank`): instruction
rows whose `loss_mask` counts very unevenly per micro-batch (one counted token beside rows
counted whole), half of them packing two examples (`documents`), read through the product's
own rows (`LocalRows`), under every strategy (DDP,
FSDP, HSDP, FSDP × TP, ZeRO-1/2/3, ZeRO-3 with its optimizer offloaded), with LoRA adapters or
without, with rayacc's cross-entropy or the user's objective; each compared with the same SGD
steps on whole windows in one process."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from tests.support.ranks.engine_helpers import full_weights

VOCAB, BLOCK = 16, 24
LR = 0.5
WINDOWS = (8, 5)
"""Rows per window: a full one (2 micro-steps of 2 rows per rank), then a short last one."""
MICRO = 2
OBJECTIVE = "jobs.objectives:label_smoothed"
WEIGHTED = "jobs.objectives:sqrt_row_weighted"
"""A weighted objective (its count a sum of weights): under the strategies that take the count
with the forward."""
WEIGHTED_UNDER = ("ddp", "fsdp", "hsdp")
STRATEGIES = {
    "ddp": {"train": {"strategy": "ddp"}},
    "fsdp": {"train": {"strategy": "fsdp"}},
    "hsdp": {"train": {"strategy": "fsdp"}, "fsdp": {"replicate": 2}},
    "fsdp × tp": {"train": {"strategy": "fsdp", "tensor_parallel": 2}},
    "zero1": {"train": {"strategy": "deepspeed"}, "deepspeed": {"stage": 1}},
    "zero2": {"train": {"strategy": "deepspeed"}, "deepspeed": {"stage": 2}},
    "zero3": {"train": {"strategy": "deepspeed"}, "deepspeed": {"stage": 3}},
    "zero3 offload": {
        "train": {"strategy": "deepspeed"},
        "deepspeed": {"stage": 3, "offload_optimizer": "cpu"},
    },
}


@dataclass(frozen=True)
class Case:
    index: int
    strategy: str
    adapters: str
    """`lora` or `none`."""
    loss: str
    """`cross-entropy` (rayacc's), `objective` (the user's `train.loss`) or `weighted` (the
    user's, counting a sum of weights)."""

    def label(self) -> str:
        return f"{self.strategy} | {self.adapters} | {self.loss}"


def cases() -> list[Case]:
    """Every strategy with adapters under rayacc's loss, and without them under the user's
    objective (adapters are refused beside tensor parallelism: that case runs both without)."""
    out = []
    for name in STRATEGIES:
        first = ("none", "cross-entropy") if name == "fsdp × tp" else ("lora", "cross-entropy")
        for adapters, loss in (first, ("none", "objective")):
            out.append(Case(len(out), name, adapters, loss))
    for name in WEIGHTED_UNDER:
        out.append(Case(len(out), name, "none", "weighted"))
    return out


def rows() -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Token rows, their masks and their `documents`: lengths 3..24, each row's counted part a
    suffix (an answer) of 1 token up to the whole row, so the counts per micro-batch differ by
    an order of magnitude; every other row packs two examples (its second one starts at a
    third of the row)."""
    rng = np.random.default_rng(17)
    tokens, masks, documents = [], [], []
    for i in range(sum(WINDOWS)):
        n = int(rng.integers(3, BLOCK + 1))
        counted = 1 if i % 3 == 0 else (n if i % 3 == 1 else int(rng.integers(1, n)))
        tokens.append(rng.integers(0, VOCAB, n))
        masks.append(np.r_[np.zeros(n - counted, np.int64), np.ones(counted, np.int64)])
        second = n // 3 if i % 2 and n >= 6 else n
        documents.append(np.r_[np.zeros(second, np.int64), np.ones(n - second, np.int64)])
    return tokens, masks, documents


def config(case: Case):
    from rayacc.config import TrainConfig

    extra = STRATEGIES[case.strategy]
    model = {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": BLOCK}
    if case.adapters == "lora":
        model["lora"] = {"r": 4, "alpha": 8, "target_modules": ["qkv", "proj", "mlp.0"]}
    train = {**extra["train"], "precision": "fp32"}
    if case.loss != "cross-entropy":
        train.update(loss=OBJECTIVE if case.loss == "objective" else WEIGHTED,
                     loss_chunk_tokens=None)  # fmt: skip
    return TrainConfig.model_validate(
        {
            "seed": 7,
            "model": model,
            "batch": {"global_batch_size": WINDOWS[0], "micro_batch_size": MICRO},
            "scaling": {"num_workers": 2},
            "optim": {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0},
            "train": train,
            **{k: v for k, v in extra.items() if k != "train"},
        }
    )


def dataset():
    from rayacc.data.sources import DatasetInfo

    return DatasetInfo(
        path="instructions.parquet",
        format="tokens",
        num_rows=sum(WINDOWS),
        vocab_size=VOCAB,
        max_tokens=BLOCK,
        loss_mask=True,
        documents=True,
    )


def _local_rows(lo: int, hi: int):
    from rayacc.data.rows import LocalRows

    tokens, masks, documents = rows()
    return LocalRows("tokens", token_lists=tokens[lo:hi], mask_lists=masks[lo:hi],
                     document_lists=documents[lo:hi])  # fmt: skip


def whole(strategy) -> torch.Tensor:
    """Every parameter whole, as one float64 vector (ZeRO-3's gathered, FSDP's DTensors)."""
    if strategy.name == "deepspeed":
        import deepspeed

        params = list(strategy.unwrapped().parameters())
        with deepspeed.zero.GatheredParameters(params):
            return torch.cat([p.detach().reshape(-1).double().clone() for p in params])
    return full_weights(strategy.unwrapped())


def run_case(case: Case, rank: int, world: int) -> dict:
    """This rank's steps of a case; every rank returns the weights after, and the items."""
    from rayacc.rank.build import build_rank

    cfg = config(case)
    parts = build_rank(cfg, dataset(), torch.device("cpu"), LR)
    tp = cfg.train.tensor_parallel
    dp, data_rank = world // tp, rank // tp
    items, lo = [], 0
    for n in WINDOWS:
        share = np.array_split(np.arange(lo, lo + n), dp)[data_rank]
        local = _local_rows(int(share[0]), int(share[-1]) + 1) if len(share) else None
        steps = math.ceil(math.ceil(n / dp) / MICRO)  # as many as the largest share needs
        pieces = np.array_split(np.arange(len(share)), steps)
        batches = [local.take(p) for p in pieces if len(p)]
        result = parts.accumulate(batches, parts.loss_fn, parts.count)
        items.append(result.items)
        lo += n
    return {"after": whole(parts.strategy), "items": items}


def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(before, after) of the same SGD steps in one process, each on a whole window: the mean
    of the loss over the window's counted targets."""
    import torch.nn.functional as F

    from jobs.objectives import label_smoothed, sqrt_row_weighted
    from rayacc.models import build_model

    model = build_model(config(case), dataset())
    before = full_weights(model)
    lo = 0
    for n in WINDOWS:
        batch = _local_rows(lo, lo + n).take(np.arange(n))
        logits = model(batch["input"], documents=batch["documents"])
        if case.loss != "cross-entropy":
            fn = label_smoothed if case.loss == "objective" else sqrt_row_weighted
            total, count = fn(logits, batch)
            loss = total / count
        else:
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["target"].reshape(-1))
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
        lo += n
    return before, full_weights(model)


def counted(lo: int, hi: int, loss: str = "cross-entropy") -> int | float:
    """The window's counted targets (a row's first token is never a target); `weighted`: the
    sum of their weights, √n for a row counting n."""
    per_row = [int(m[1:].sum()) for m in rows()[1][lo:hi]]
    if loss == "weighted":
        return math.fsum(math.sqrt(n) for n in per_row)
    return sum(per_row)


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from tests.support.ranks.dist_workers import run_scenarios

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))

    def scenario(case: Case):
        def run(rank: int, world: int, out: dict) -> None:
            out[case.index] = run_case(case, rank, world)

        return run

    run_scenarios(rank, world, init_file, out_dir, [scenario(c) for c in cases()])
