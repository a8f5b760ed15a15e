"""Tensor parallelism under accumulation on gloo ranks: the matrix's GPT, windows and
single-process full-batch reference (tests/support/ranks/matrix.py), each case on a 2-D mesh
(data-parallel × tensor-parallel ranks) built by the FSDP strategy with `tensor_parallel`;
every rank of a tensor-parallel group reads its group's rows (its data-parallel rank's share).
A case with a resume saves its first window's state through the strategy (DCP) on one mesh
and goes on from it on another."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.support.ranks import matrix as M
from tests.support.ranks.engine_helpers import full_weights


@dataclass(frozen=True)
class TPCase:
    index: int
    dp: int
    tp: int
    grad_sync: str
    last: str
    resume: tuple[int, int] | None = None
    """(dp, tp) of the mesh the case resumes on after its first window."""
    model: str = "gpt"
    """`gpt` (the built-in, its fused q, k, v) or `llama` (a transformers Llama: its own plan)."""
    replicate: int = 1
    """HSDP's replica groups over the data-parallel ranks (the first phase's mesh)."""

    def config(self):
        cfg = M.config(self.matrix_case(), rules=False)
        if self.model == "gpt":
            return cfg
        hf = {"model_type": "llama", "vocab_size": M.VOCAB, "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "max_position_embeddings": M.BLOCK}  # fmt: skip
        return cfg.model_validate(
            {**cfg.model_dump(), "model": {"name": "hf", "hf": {"config": hf}}}
        )

    def matrix_case(self) -> M.Case:
        """The matrix's case of the same model, windows and reference."""
        return M.Case(self.index, f"fsdp {self.grad_sync}", "none", "fixed", self.dp * self.tp,
                      "fp32", "plain", self.last, "none")  # fmt: skip

    def label(self) -> str:
        moved = f", resumed on {self.resume[0]} × {self.resume[1]}" if self.resume else ""
        mesh = f"{self.model} {self.dp} × {self.tp} (dp × tp)"
        if self.replicate > 1:
            mesh = (f"{self.model} HSDP {self.replicate} × {self.dp // self.replicate} × "
                    f"{self.tp} (replicate × shard × tp)")  # fmt: skip
        return f"{mesh}, {self.grad_sync}, {self.last} last{moved}"


PER_LAYER = {"gpt": (4, 1), "llama": (7, 0)}
"""Each layer's tensor-parallel collectives in one micro-step, from the plans: the GPT's fused
q, k, v (its input's gradient all-reduced in backward, its bias's share gathered) and MLP
input (all-reduced in backward), attention and MLP outputs (all-reduced in forward); the
Llama's q, k, v, gate and up each all-reduce their input's gradient, o and down their output."""


def run_phase(case: TPCase, rank: int, world: int, folder: Path, phase: str) -> dict | None:
    """This rank's part of a case's phase (A: the whole run, or its first window when the case
    resumes; B: the rest, on the resume mesh); rank 0 returns the full weights at the end."""
    import torch.distributed as dist

    from rayacc.engine.parallel import FSDP
    from rayacc.engine.step import AccumulationStep
    from rayacc.models.registry import loss_functions
    from rayacc.optim import build_optimizer
    from rayacc.rank.build import model_recipe

    dp, tp = case.resume if phase == "B" else (case.dp, case.tp)
    cfg, info = case.config(), M.dataset()
    device = torch.device("cpu")
    replicate = 1 if phase == "B" else case.replicate
    strategy = FSDP(case.grad_sync, tensor_parallel=tp, replicate=replicate)
    model = strategy.build(model_recipe(cfg, info), device)
    optimizer = build_optimizer(cfg.optim, model.parameters(), M.LR, device, strategy)
    loss_fn, count = loss_functions(info, None, strategy)
    step = AccumulationStep(model, optimizer, strategy=strategy)
    windows = M.phase_windows(strategy, model, optimizer, folder, rank, phase,
                              M.windows(case.matrix_case()), resumes=bool(case.resume))  # fmt: skip
    here = dist.get_rank(strategy.process_group)  # the data-parallel rank: its group's rows
    assert dist.get_world_size(strategy.process_group) == dp
    steps = []
    for window in windows:
        mine = M.rank_share(window, here, dp)
        mbs = M.micro_batches(mine, M.MICRO, dp, len(window))
        steps.append(step(mbs, loss_fn, count, figures=[float(rank), float(here)]))
    # the tensor-parallel group's collectives each window counted, with its micro-steps
    calls = [(r.tensor_parallel_calls, r.micro_steps) for r in steps]
    if phase == "A" and case.resume:
        M.save_for_phase_b(strategy, model, optimizer, folder, rank)
        return None
    full = full_weights(strategy.unwrapped())  # a collective: every rank gathers
    if rank != 0:
        return None
    # every rank's figures (its rank, its data-parallel rank) and its place on the mesh
    seen = {"figures": steps[-1].figures_by_rank, "places": strategy.mesh_coordinates()}
    # the parameters rank 0 holds: its shard of its share of the model
    seen["held"] = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
    return {"params": full, "mesh": strategy.describe_mesh(), "calls": calls, **seen}


"""Rank body: every case of one (phase, ranks) group in one gloo group."""
