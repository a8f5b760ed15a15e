"""Pipeline parallelism under accumulation on gloo ranks: the matrix's GPT (4 blocks), windows
and single-process full-batch reference (tests/support/ranks/matrix.py), each case on a
(pipeline × data-parallel) mesh built by the FSDP strategy with `pipeline_parallel`; every
stage of a pipeline reads its data-parallel rank's rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.support.ranks import matrix as M

ROW_OBJECTIVE = "tests.support.ranks.pipeline:row_mean"


def row_mean(output: torch.Tensor, batch) -> tuple[torch.Tensor, int]:
    """A user objective with one item a row: the mean cross-entropy of the row's targets,
    counted as the rows it was given (a pipeline's padding rows must never reach it)."""
    import torch.nn.functional as F

    target = batch["target"]
    keep = (target != -100).float()
    tokens = F.cross_entropy(output.float().transpose(1, 2), target.clamp(min=0), reduction="none")
    per_row = (tokens * keep).sum(-1) / keep.sum(-1).clamp(min=1.0)
    return per_row.sum(), int(target.shape[0])


@dataclass(frozen=True)
class PPCase:
    index: int
    pp: int
    dp: int
    schedule: str
    last: str
    clip: float | None = None
    epochs: int = 1
    """Passes over the windows (a short last window followed by full ones)."""
    resume: tuple[int, int] | None = None
    """(pp, dp) of the mesh the case resumes on after its first window (pp 1: FSDP alone;
    no tensor parallelism)."""
    tp: int = 1
    """Tensor-parallel ranks inside each stage (the first phase's mesh)."""
    replicate: int = 1
    """HSDP's replica groups over each stage's data-parallel ranks (the first phase's mesh)."""
    recompute: bool = False
    """Activation checkpointing of every block."""
    model: str = "gpt"
    """`gpt` (the built-in, 4 blocks) or `llama` (a transformers Llama of 4 layers, its head
    tied or not)."""
    lora: bool = False
    """LoRA adapters on the attention (the base frozen: the tied embedding and head too)."""
    rows: tuple[int, ...] = ()
    """Rows of each window where not the matrix's (12, 12, 12 or 7)."""
    loss: str = "tokens"
    """`tokens` (rayacc's cross-entropy) or `rows` (a user objective with one item a row:
    `ROW_OBJECTIVE`)."""

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def config(self):
        cfg = M.config(self.matrix_case(), rules=False)
        data = cfg.model_dump()
        data["model"]["n_layer"] = 4
        data["train"]["activation_checkpointing"] = "full" if self.recompute else "none"
        if self.model.startswith("llama"):
            hf = {"model_type": "llama", "vocab_size": M.VOCAB, "hidden_size": 16,
                  "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
                  "num_key_value_heads": 2, "max_position_embeddings": 4 * M.BLOCK,
                  "tie_word_embeddings": self.model == "llama tied"}  # fmt: skip
            data["model"] = {"name": "hf", "hf": {"config": hf}}
        if self.loss == "rows":
            data["train"].update(loss=ROW_OBJECTIVE, loss_chunk_tokens=None)
        if self.lora:
            data["model"]["lora"] = {"r": 4, "alpha": 8}
        return cfg.model_validate(data)

    def matrix_case(self) -> M.Case:
        return M.Case(self.index, "fsdp window_end", "none", "fixed", self.pp * self.dp,
                      "fp32", "plain", self.last, "none")  # fmt: skip

    def label(self) -> str:
        clip = f", clipped at {self.clip}" if self.clip else ""
        epochs = f", {self.epochs} epochs" if self.epochs > 1 else ""
        epochs += ", recomputed" if self.recompute else ""
        moved = f", resumed on {self.resume[0]} × {self.resume[1]}" if self.resume else ""
        mesh = f"{self.pp} × {self.dp} (pp × dp)"
        if self.tp > 1:
            mesh = f"{self.pp} × {self.dp} × {self.tp} (pp × dp × tp)"
        if self.replicate > 1:
            mesh = (f"{self.pp} × {self.replicate} × {self.dp // self.replicate} "
                    "(pp × replicate × shard)")  # fmt: skip
        model = "" if self.model == "gpt" else f"{self.model}, "
        loss = ", an objective counting rows" if self.loss == "rows" else ""
        loss += f", windows of {'/'.join(map(str, self.rows))} rows" if self.rows else ""
        loss += ", LoRA" if self.lora else ""
        return f"{model}{self.schedule} {mesh}, {self.last} last{clip}{epochs}{moved}{loss}"

    def items(self, window: list) -> int:
        """The window's loss items: its targets (a sequence of n tokens holds n − 1), or its
        rows."""
        return len(window) if self.loss == "rows" else sum(len(s) - 1 for s in window)

    def mesh(self, phase: str) -> tuple[int, int]:
        return self.resume if phase == "B" and self.resume else (self.pp, self.dp)

    def windows(self) -> list:
        if not self.rows:
            return M.windows(self.matrix_case()) * self.epochs
        from tests.support.ranks.engine_helpers import token_sequences

        seqs = token_sequences(sum(self.rows), seed=31, min_len=2, max_len=M.BLOCK + 1)
        seqs = [s.clamp(max=M.VOCAB - 1) for s in seqs]
        starts = [sum(self.rows[:i]) for i in range(len(self.rows))]
        return [seqs[a : a + n] for a, n in zip(starts, self.rows, strict=True)] * self.epochs


def run_phase(case: PPCase, rank: int, world: int, folder: Path, phase: str) -> dict | None:
    import torch.distributed as dist

    from rayacc.engine.parallel import FSDP
    from rayacc.engine.step import AccumulationStep
    from rayacc.models.registry import loss_functions
    from rayacc.optim import build_optimizer
    from rayacc.rank.build import model_recipe

    cfg, info = case.config(), M.dataset()
    device = torch.device("cpu")
    pp, dp = case.mesh(phase)
    tp, replicate = (1, 1) if phase == "B" else (case.tp, case.replicate)
    strategy = FSDP("window_end", pipeline_parallel=pp, pipeline_schedule=case.schedule,
                    tensor_parallel=tp, replicate=replicate)  # fmt: skip
    model = strategy.build(model_recipe(cfg, info), device)
    optimizer = build_optimizer(cfg.optim, model.parameters(), M.LR, device, strategy)
    loss_fn, count = loss_functions(info, None, strategy, cfg.train.loss)
    step = AccumulationStep(model, optimizer, strategy=strategy, max_grad_norm=case.clip)
    here = dist.get_rank(strategy.data_group) if strategy.data_group is not None else rank
    windows = M.phase_windows(strategy, model, optimizer, folder, rank, phase, case.windows(),
                              resumes=bool(case.resume))  # fmt: skip
    results = []
    for window in windows:
        mine = M.rank_share(window, here, dp)
        mbs = M.micro_batches(mine, M.MICRO, dp, len(window))
        results.append(step(mbs, loss_fn, count))
    if phase == "A" and case.resume:
        M.save_for_phase_b(strategy, model, optimizer, folder, rank)
        return None
    # the trained stages' forwards alone on the first window (validation's path): its mean
    # item loss over every rank
    first = case.windows()[0]
    mine = M.rank_share(first, here, dp)
    val = torch.zeros(1, dtype=torch.float64)
    if strategy.contract.pipelined:
        sums, _ = strategy.run_pipeline(M.micro_batches(mine, M.MICRO, dp, len(first)),
                                        loss_fn, train=False)  # fmt: skip
        val += sum(sums)
    from rayacc.engine import all_reduce

    val = all_reduce(val, group=strategy.process_group)  # a tensor-parallel group once
    from torch.distributed.tensor import DTensor

    # every rank: its stages' parameters by name, whole (a collective over its stage's ranks)
    mine = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}  # fmt: skip
    box = [None] * world
    dist.all_gather_object(box, mine)
    # every block of this rank's stages recomputed where asked (a rank per stage: no sharding)
    blocks = strategy.unwrapped().fsdp_blocks()
    recomputed = all(getattr(b, "recomputed", False) for b in blocks) and bool(blocks)
    # what each rank holds: its shards of its stages
    held = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
    holds = [None] * world
    dist.all_gather_object(holds, held)
    if rank != 0:
        return None
    merged = {}
    for part in box:
        merged.update(part)
    from rayacc.models import build_model

    order = [n for n, _ in build_model(cfg, info).named_parameters()]
    flat = torch.cat([merged[n].reshape(-1).double() for n in order])
    # a tied weight's copy on the last stage against the first stage's
    ties = build_model(cfg, info).pipeline_tied().items()
    gaps = [(merged[a] - merged[b]).abs().max() for a, b in ties if a in merged and b in merged]
    tied_gap = float(max(gaps, default=0.0))
    seen = {k: [getattr(r, k) for r in results] for k in ("loss", "grad_norm", "items", "samples")}
    seen["pipeline"] = [(r.pipeline, r.step_time_s) for r in results]
    # the tensor-parallel group's collectives each window, and the blocks rank 0's stages hold
    seen["calls"] = [(r.tensor_parallel_calls, r.micro_steps) for r in results]
    seen["blocks"] = len(blocks)
    seen["width"] = getattr(strategy.pipeline, "width", None)  # what each row is padded to
    val_loss = float(val[0]) / case.items(first)
    return {"params": flat, "tied_gap": tied_gap, "mesh": strategy.describe_mesh(), "held": holds,
            "recomputed": recomputed,
            "val_loss": val_loss, **seen}  # fmt: skip


"""Rank body: every case of one rank count in one gloo group."""


def reference(case: PPCase) -> tuple[torch.Tensor, torch.Tensor, list[float], float]:
    """(initial, final) weights, each window's gradient norm of the same steps on whole
    windows in one process (the matrix's reference, clipped where the case clips), and the
    trained model's mean loss on the first window."""
    import torch.nn.functional as F

    from rayacc.engine import IGNORE_INDEX, collate_tokens
    from rayacc.models import build_model

    model = build_model(case.config(), M.dataset())
    flat = lambda: torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])  # noqa: E731
    before, norms = flat(), []
    opt = torch.optim.SGD(model.parameters(), lr=M.LR, momentum=M.MOMENTUM)

    def mean_loss(batch) -> torch.Tensor:
        logits = model(batch["input"])
        if case.loss == "rows":
            total, count = row_mean(logits, batch)
            return total / count
        return F.cross_entropy(logits.reshape(-1, M.VOCAB), batch["target"].reshape(-1),
                               ignore_index=IGNORE_INDEX)  # fmt: skip

    for window in case.windows():
        loss = mean_loss(collate_tokens(window))
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip or 1e9)))
        opt.step()
    with torch.no_grad():
        val = mean_loss(collate_tokens(case.windows()[0]))
    return before, flat(), norms, float(val)
