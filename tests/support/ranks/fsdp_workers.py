"""Rank bodies for the 2-process gloo FSDP2 tests (plain torch.multiprocessing, no Ray).

Each scenario shards a small GPT (2 blocks) with FSDP2 over both ranks and runs windows of
padded variable-length token micro-batches through the accumulation step; every rank writes the
full weights it ends with (and the step results) to `out_dir/rank{r}.pt`.
"""

from __future__ import annotations

import functools

import torch

from rayacc.engine import DDP, FSDP, AccumulationStep, count_target_tokens, token_item_losses
from rayacc.engine.parallel.fsdp_mesh import shard_model
from rayacc.models.gpt import GPT
from tests.support.ranks.engine_helpers import full_weights, token_micro_batches, token_sequences

VOCAB, BLOCK = 16, 16
MICRO = 2
WINDOWS = [16, 16, 10]
"""Sequences per window: two full windows and a short last one (5 per rank, 3 micro-steps)."""


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, BLOCK, n_layer=2, n_head=2, n_embd=16)


def windows() -> list[list[torch.Tensor]]:
    seqs = token_sequences(sum(WINDOWS), seed=9, min_len=2, max_len=BLOCK + 1)
    seqs = [s.clamp(max=VOCAB - 1) for s in seqs]
    out, at = [], 0
    for n in WINDOWS:
        out.append(seqs[at : at + n])
        at += n
    return out


def rank_share(window: list[torch.Tensor], rank: int, world: int) -> list[torch.Tensor]:
    """Contiguous share, the first ranks one more when the window does not divide."""
    base, extra = divmod(len(window), world)
    lo = rank * base + min(rank, extra)
    return window[lo : lo + base + (1 if rank < extra else 0)]


def micro_split(seqs: list[torch.Tensor], steps: int) -> list[dict[str, torch.Tensor]]:
    sizes = [len(a) for a in torch.tensor_split(torch.arange(len(seqs)), steps)]
    out, at = [], 0
    for n in sizes:
        out += token_micro_batches(seqs[at : at + n], n)
        at += n
    return out


def scenario(rank: int, world: int, out: dict, mode: str) -> None:
    """`mode`: an FSDP gradient-sync mode, or `ddp` (the same steps under DDP: the yardstick
    of float rounding for the FSDP runs)."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(gpt())
    else:
        model = shard_model(gpt(), device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sync = "every_micro_step" if mode == "ddp" else mode
    strategy = DDP().adopt(model) if mode == "ddp" else FSDP(sync).adopt(model)
    step = AccumulationStep(model, opt, max_grad_norm=0.5, strategy=strategy)
    results = []
    for window in windows():
        mine = rank_share(window, rank, world)
        steps = -(-len(window) // world // MICRO)  # the same micro-steps on every rank
        results.append(step(micro_split(mine, steps), token_item_losses, count_target_tokens))
    inner = model.module if mode == "ddp" else model
    out[mode] = {"params": full_weights(inner), "results": results}


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from tests.support.ranks.dist_workers import run_scenarios

    modes = ("ddp", "every_micro_step", "window_end")
    scenarios = [functools.partial(scenario, mode=mode) for mode in modes]
    background = functools.partial(background_save, folder=f"{out_dir}/background")
    run_scenarios(rank, world, init_file, out_dir, [*scenarios, search, background])


def background_save(rank: int, world: int, out: dict, folder: str) -> None:
    """A checkpoint written in the background (train.checkpoint_mode=async) holds the state of
    the step it was taken at, although training goes on meanwhile: after window 1 the sharded
    state is saved with the write left in flight, windows 2 and 3 train (their collectives on
    the training group while the save's run on its own), then the write is waited for and
    loaded into a fresh sharded model and optimizer. DDP's copy, the same way."""
    from rayacc.engine.parallel import SHARDS_DIR
    from rayacc.engine.parallel.shards import load_sharded

    model = shard_model(gpt(), device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    strategy = FSDP("every_micro_step").adopt(model)
    step = AccumulationStep(model, opt, max_grad_norm=0.5, strategy=strategy)

    def train(window: list[torch.Tensor]) -> None:
        mine = rank_share(window, rank, world)
        steps = -(-len(window) // world // MICRO)
        step(micro_split(mine, steps), token_item_losses, count_target_tokens)

    first, *rest = windows()
    train(first)
    at_save = full_weights(model)
    whole, written = strategy.state.save(strategy.model, opt, folder, rank, background=True)
    for window in rest:
        train(window)
    written()
    after = full_weights(model)
    fresh = shard_model(gpt(), device=torch.device("cpu"))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.02, weight_decay=0.1)
    load_sharded(f"{folder}/{SHARDS_DIR}", fresh, fresh_opt)
    out["background"] = {"whole": whole, "at_save": at_save, "after": after}
    out["background"]["loaded"] = full_weights(fresh)

    ddp_model = torch.nn.parallel.DistributedDataParallel(gpt())
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=0.02)
    ddp = DDP().adopt(ddp_model)
    copy, _ = ddp.state.save(ddp.model, ddp_opt, folder, rank, background=True)
    if rank == 0:
        before = {k: v.clone() for k, v in copy["model"].items()}
        with torch.no_grad():
            for p in ddp_model.parameters():
                p.add_(1.0)
        out["background"]["ddp_copy_kept"] = all(
            torch.equal(before[k], copy["model"][k]) for k in before
        )


def search(rank: int, world: int, out: dict) -> None:
    """`micro_batch_size: auto` on a sharded GPT, rank 0's budget fitting every size and rank
    1's only 2 of 8 per worker: rank 0 alone would try 2, 4 and 8, rank 1 2 and 4. Each trial's
    forward is a collective, so the ranks must try the same sizes."""
    from rayacc.engine.autobatch import find_micro_batch_size, measure_step_bytes

    model = shard_model(gpt(), device=torch.device("cpu"))
    seqs = token_sequences(8, seed=rank, min_len=BLOCK + 1, max_len=BLOCK + 1)
    seqs = [s.clamp(max=VOCAB - 1) for s in seqs]

    def make_batch(n: int):
        return token_micro_batches(seqs[:n], n)[0]

    used = {n: measure_step_bytes(model, token_item_losses, make_batch(n)) for n in (2, 4, 8)}
    budget = used[8] + 1 if rank == 0 else (used[2] + used[4]) // 2
    found = find_micro_batch_size(
        model, token_item_losses, make_batch, samples_per_worker=8, budget_bytes=budget
    )
    out["search"] = {"used": used, "found": found}


def seeded_config():
    from rayacc.config import TrainConfig
    from rayacc.data.sources import DatasetInfo

    cfg = TrainConfig.model_validate(
        {
            "seed": 11,
            "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
            "train": {"strategy": "fsdp"},
        }
    )
    # 17 rows of token embeddings: uneven chunks at 2 and 3 ranks
    info = DatasetInfo(
        path="tokens.parquet", format="tokens", num_rows=64, vocab_size=17, max_tokens=9
    )
    return cfg, info


def materialise(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """The run's sharded build, with building the whole model forbidden: the full weights it
    ends with and how many elements this rank holds."""
    from tests.support.ranks.dist_workers import run_scenarios

    def scenario(rank: int, world: int, out: dict) -> None:
        from torch.distributed.tensor import DTensor

        import rayacc.rank.build as parallel

        def whole(*args, **kwargs):
            raise AssertionError("a rank built the whole model")

        parallel.build_model = whole
        cfg, info = seeded_config()
        model = parallel.strategy_for(cfg).build(
            parallel.model_recipe(cfg, info), torch.device("cpu")
        )
        out["full"] = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()
        }
        out["held"] = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()
        )

    run_scenarios(rank, world, init_file, out_dir, [scenario])
