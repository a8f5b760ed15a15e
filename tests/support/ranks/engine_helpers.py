"""Small models, data and single-process full-batch references for the engine's tests."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from rayacc.engine import IGNORE_INDEX, collate_tokens

N_FEATURES, N_CLASSES, VOCAB = 8, 3, 11


class TinyClassifier(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(N_FEATURES, 16), nn.Tanh(), nn.Linear(16, N_CLASSES))

    def forward(self, x):
        return self.net(x)


class TinyCausalLM(nn.Module):
    """Embedding → causal running mean over earlier positions → MLP head. Right padding is
    invisible to real positions, as in a causal transformer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, idx):
        e = self.emb(idx)
        positions = torch.arange(1, idx.shape[1] + 1, device=idx.device).view(1, -1, 1)
        h = torch.tanh(self.mix(e.cumsum(dim=1) / positions))
        return self.head(h)


def classification_rows(n: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "features": torch.randn(n, N_FEATURES, generator=g),
        "label": torch.randint(0, N_CLASSES, (n,), generator=g),
    }


def slice_rows(rows: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in rows.items()}


def micro_batches(rows: dict[str, torch.Tensor], micro: int) -> list[dict[str, torch.Tensor]]:
    n = len(next(iter(rows.values())))
    return [slice_rows(rows, i, min(i + micro, n)) for i in range(0, n, micro)]


def token_sequences(
    n: int, seed: int = 2, min_len: int = 2, max_len: int = 14
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(0, VOCAB, (int(L),), generator=g) for L in lengths]


def token_micro_batches(seqs: list[torch.Tensor], micro: int) -> list[dict[str, torch.Tensor]]:
    return [collate_tokens(seqs[i : i + micro]) for i in range(0, len(seqs), micro)]


def reference_sgd_step(
    model: nn.Module, loss: torch.Tensor, lr: float, max_grad_norm=None
) -> float:
    """w − lr·∇loss in one process (optionally clipped); returns the pre-clip gradient norm."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf")))
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return norm


def full_batch_classification_loss(model: nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(rows["features"]), rows["label"])


def full_batch_token_loss(model: nn.Module, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Mean over every target token of the global batch (padding excluded)."""
    batch = collate_tokens(seqs)
    logits = model(batch["input"])
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), batch["target"].reshape(-1), ignore_index=IGNORE_INDEX
    )


def params_vector(model: nn.Module) -> torch.Tensor:
    inner = model.module if hasattr(model, "module") else model
    return torch.cat([p.detach().reshape(-1).double() for p in inner.parameters()])


def full_weights(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (a sharded one gathered: a collective), as one float64 vector."""
    from torch.distributed.tensor import DTensor

    parts = []
    for p in model.parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        parts.append(t.detach().reshape(-1).double())
    return torch.cat(parts)


def update_rel_err(before: torch.Tensor, after: torch.Tensor, ref_after: torch.Tensor) -> float:
    """‖Δ − Δ_ref‖ / ‖Δ_ref‖ over all parameters: the error of the update, not of the weights."""
    ref_update = ref_after - before
    return float((after - ref_after).norm() / ref_update.norm())


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def _then_exit(rank: int, target, *args) -> None:
    """Runs one rank's body and leaves without the interpreter's teardown. The body has saved
    its results and destroyed its process group; what is left is finalisation, where a gloo
    or ATen thread pool thread still joinable when its C++ owner is destroyed aborts the
    process ("terminate called without an active exception", SIGABRT; seen once on a rank of
    the 3-rank combination matrix). A body that raises still fails its rank as before."""
    target(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(target, world: int, folder, what: str, deadline_s: float = 240) -> list[dict]:
    """Runs `target(rank, world, init_file, out_dir)` on `world` spawned processes and returns
    what each rank saved to `out_dir/rank{r}.pt`; a hang (past `deadline_s`) fails the test
    instead of the suite."""
    import time

    import pytest
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _then_exit,
        args=(target, world, str(folder / "init"), str(folder)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"the {what} hung (a collective never matched)")
    except mp.ProcessExitedException as exc:
        # whether the lost rank had saved its results tells a crash in the work from one at exit
        saved = [r for r in range(world) if (folder / f"rank{r}.pt").is_file()]
        pytest.fail(f"the {what}: {exc} (ranks that saved their results: {saved})")
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


def hf_weights_first_step(cfg_of, build_parts, rank: int, world: int) -> dict[str, float]:
    """`model.hf.weights`: a tiny Llama saved by `save_pretrained` (the folder `rayacc export`
    writes for an `hf` model), trained for one window on this rank's share of two token
    windows; (the step's loss, transformers' own forward loss on the whole batch from that
    folder). `cfg_of(model)`: the job with that model section; `build_parts(cfg)`: (step, loss
    function, item counter) as the strategy builds them."""
    import tempfile

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.support.models.hf_configs import tiny_llama

    config = tiny_llama(VOCAB)
    # one folder every rank reads (transformers saves on the first rank of a process group)
    shared = [tempfile.mkdtemp(prefix="hf-weights-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    folder = shared[0]
    if rank == 0:
        torch.manual_seed(11)
        source = AutoModelForCausalLM.from_config(LlamaConfig(**config))
        with torch.no_grad():  # none of them an initialisation's
            for p in source.parameters():
                p.add_(0.05 * torch.randn_like(p))
        source.save_pretrained(folder)
    dist.barrier()
    seqs = [s.clamp(max=VOCAB - 1) for s in token_sequences(16, seed=60, min_len=2, max_len=12)]
    mine = seqs[rank * len(seqs) // world : (rank + 1) * len(seqs) // world]
    model = {"name": "hf", "hf": {"config": config, "weights": folder}}
    step, loss_fn, count = build_parts(cfg_of(model))
    result = step(token_micro_batches(mine, 4), loss_fn, count)
    theirs = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    batch = collate_tokens(seqs)
    with torch.no_grad():
        logits = theirs(input_ids=batch["input"]).logits
        reference = F.cross_entropy(
            logits.reshape(-1, VOCAB), batch["target"].reshape(-1), ignore_index=IGNORE_INDEX
        )
    return {"loss": float(result.loss), "transformers": float(reference)}
