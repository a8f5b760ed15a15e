"""Rank bodies for the 4-process gloo HSDP tests (plain torch.multiprocessing, no Ray).

Ranks 0 and 2 play one node and 1 and 3 another (`node`): `fsdp.replicate: auto` gives a 2 × 2 mesh,
each shard group inside a node. Each scenario trains the small GPT of fsdp_workers over its
three windows (two full, one short) with SGD and clipping; every rank writes the full weights
after each window and the step results to `out_dir/rank{r}.pt`. The checkpoint scenario saves
at 2 × 2 after window 1 and loads it at 4 × 1 (4 ranks) and at 1 × 2 (2 ranks: ranks 2–3
leave and ranks 0–1 form a group of their own), then trains window 2 at each shape.
"""

from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist

from rayacc.engine import FSDP, AccumulationStep, count_target_tokens, token_item_losses
from rayacc.engine.parallel import ModelRecipe
from tests.support.models.hf_configs import tiny_llama
from tests.support.ranks.engine_helpers import full_weights
from tests.support.ranks.fsdp_workers import gpt, micro_split, rank_share, windows

WORLD = 4
MICRO = 2
LR, MOMENTUM, CLIP = 0.2, 0.9, 0.5
CASES = {
    # name: (fsdp.grad_sync, fsdp.replicate, fsdp.offload)
    "hsdp every_micro_step": ("every_micro_step", "auto", False),
    "hsdp window_end": ("window_end", "auto", False),
    "fsdp offload": ("every_micro_step", 1, True),
    "hsdp offload": ("every_micro_step", 2, True),
}


HF_LLAMA = tiny_llama(vocab_size=16)
"""A tiny `transformers` Llama (built here: nothing fetched), for HSDP with its decoder layers
as the blocks sharded and recomputed."""


def hf_llama():
    from rayacc.models.hf import build_hf

    torch.manual_seed(0)
    return build_hf(HF_LLAMA, None, 16, 17)


def node(rank: int) -> str:
    # the nodes interleaved in rank order: each shard group must be gathered across the ranks
    return f"node{rank % 2}"


def build(grad_sync: str, replicate, offload: bool, rank: int, recipe=None):
    strategy = FSDP(grad_sync, replicate=replicate, node=node(rank), offload=offload)
    model = strategy.build(recipe or ModelRecipe(build=gpt), torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    step = AccumulationStep(model, opt, max_grad_norm=CLIP, strategy=strategy)
    return strategy, model, opt, step


def train(step, window, rank: int, world: int):
    mine = rank_share(window, rank, world)
    steps = -(-len(window) // world // MICRO)  # the same micro-steps on every rank
    return step(micro_split(mine, steps), token_item_losses, count_target_tokens)


def case(rank: int, world: int, out: dict, name: str) -> None:
    strategy, model, _, step = build(*CASES[name], rank)
    results, weights = [], []
    for window in windows():
        results.append(train(step, window, rank, world))
        weights.append(full_weights(model))
    out[name] = {"weights": weights, "results": results, "mesh": str(strategy.mesh)}
    param = next(model.parameters())
    out[name]["param_device"] = str(param.to_local().device)
    out[name]["mesh_ranks"] = param.device_mesh.mesh.tolist()


def hf_case(rank: int, world: int, out: dict) -> None:
    """HSDP 2 × 2 of the transformers Llama, every decoder layer a unit and recomputed."""
    recipe = ModelRecipe(build=hf_llama, activation_checkpointing=1)
    strategy, model, _, step = build("every_micro_step", "auto", False, rank, recipe)
    weights = []
    for window in windows():
        train(step, window, rank, world)
        weights.append(full_weights(model))
    blocks = strategy.unwrapped().fsdp_blocks()
    out["hf"] = {"weights": weights, "units": len(strategy._units()), "blocks": len(blocks)}
    out["hf"]["recomputed"] = sum(bool(getattr(b, "recomputed", False)) for b in blocks)


def reshard(rank: int, world: int, out: dict, folder: str) -> None:
    from rayacc.engine.parallel.shards import load_sharded, save_sharded

    first, second, _ = windows()
    _, model, opt, step = build("every_micro_step", 2, False, rank)
    train(step, first, rank, world)
    save_sharded(folder, model, opt)
    saved = full_weights(model)
    train(step, second, rank, world)
    out["reshard"] = {"saved": saved, "after": full_weights(model)}

    _, model, opt, step = build("every_micro_step", 4, False, rank)
    load_sharded(folder, model, opt)
    out["reshard"]["4x1 loaded"] = full_weights(model)
    train(step, second, rank, world)
    out["reshard"]["4x1 after"] = full_weights(model)


def reshard_to_two(rank: int, out_dir: str, folder: str) -> None:
    """Ranks 0–1 alone, in a group of 2 (1 × 2), load the 2 × 2 checkpoint and train window 2."""
    from rayacc.engine.parallel.shards import load_sharded

    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/init2",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    out = torch.load(f"{out_dir}/rank{rank}.pt", weights_only=False)
    try:
        _, model, opt, step = build("every_micro_step", 1, False, rank)
        load_sharded(folder, model, opt)
        out["reshard"]["1x2 loaded"] = full_weights(model)
        train(step, windows()[1], rank, 2)
        out["reshard"]["1x2 after"] = full_weights(model)
    finally:
        torch.save(out, f"{out_dir}/rank{rank}.pt")
        dist.destroy_process_group()


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from tests.support.ranks.dist_workers import run_scenarios

    folder = f"{out_dir}/ckpt"
    scenarios = [functools.partial(case, name=name) for name in CASES]
    scenarios += [hf_case, functools.partial(reshard, folder=folder)]
    run_scenarios(rank, world, init_file, out_dir, scenarios)
    if rank < 2:
        reshard_to_two(rank, out_dir, folder)
