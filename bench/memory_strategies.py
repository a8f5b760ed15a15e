"""Memory strategies on CPU: DDP vs FSDP2 (both gradient-sync modes) × activation
checkpointing off/on, DeepSpeed ZeRO stages 1-3 with optimizer offload off/on, FSDP with
offload, HSDP (2 replica groups, at 4 ranks or more) and FSDP × tensor parallelism (2 × 2 at
4 ranks); 2 gloo ranks by default, a GPT of about 64M parameters.

For each setting, 2 fresh processes train 3 windows of 2 micro-steps (micro-batch 4 × 256
tokens per rank) with AdamW through rayacc's accumulation step and print per rank: the peak
resident memory (ru_maxrss), the parameter and optimizer-state bytes the rank holds, the bytes
autograd saved for backward in one micro-step, the median time of the last 2 windows and the
window's gradient collectives (reduce-scatters, all-reduces) as the strategy counted them.

    .venv/bin/python bench/memory_strategies.py
    .venv/bin/python bench/memory_strategies.py --layers 4 --width 256   # a quick look
    .venv/bin/python bench/memory_strategies.py --strategies deepspeed   # the ZeRO rows only
    .venv/bin/python bench/memory_strategies.py --world 4 --strategies ddp,fsdp,hsdp
    .venv/bin/python bench/memory_strategies.py --world 4 --strategies fsdp,tp --layers 4

On a GPU (one process per GPU, NCCL, bf16), the same script takes `--device cuda` and reports
`torch.cuda.max_memory_allocated` instead; commands for GPT-2 124M and a 1B model are in
bench/results/memory_strategies.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = [
    ("ddp", None, "none"),
    ("fsdp", "every_micro_step", "none"),
    ("fsdp", "window_end", "none"),
    ("ddp", None, "full"),
    ("fsdp", "every_micro_step", "full"),
    ("fsdp", "window_end", "full"),
    *(
        ("deepspeed", f"zero{stage} offload {offload}", "none")
        for stage in (1, 2, 3)
        for offload in ("none", "cpu")
    ),
    ("fsdp", "every_micro_step offload", "none"),
    ("hsdp", "every_micro_step", "none"),
    ("hsdp", "window_end", "none"),
    ("tp", "every_micro_step", "none"),
    ("tp", "window_end", "none"),
]
"""(strategy, its mode, activation checkpointing). `hsdp`: FSDP with 2 replica groups (ranks
0..W/2-1 playing one node, the rest another); needs an even --world of 4 or more. `tp`: FSDP
over W/2 data-parallel ranks × 2 tensor-parallel (`train.tensor_parallel: 2`); an even
--world."""


def deepspeed_strategy(mode: str, args: dict, model):
    """rayacc's DeepSpeed strategy for `mode` ("zero<stage> offload <device>") over `model`."""
    from rayacc.engine.parallel.deepspeed import DeepSpeed
    from rayacc.engine.parallel.deepspeed_config import deepspeed_config

    stage, _, offload = mode.split()
    config = deepspeed_config(
        stage=int(stage.removeprefix("zero")),
        offload_optimizer=offload,
        offload_params="none",
        micro_batch_size=args["micro"],
        grad_accum_steps=args["accum"],
        num_workers=args["world"],
        max_grad_norm=None,
        precision="fp32",
    )
    return DeepSpeed(config).adopt(model)


def held_params(model) -> list[torch.Tensor]:
    """The parameter tensors this rank holds: ZeRO-3's partitions (`ds_tensor`), DTensor
    shards, or the whole tensors."""
    return [getattr(p, "ds_tensor", p) for p in model.parameters()]


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def rank_body(rank: int, world: int, init: str, out: str, args: dict) -> None:
    if args["device"] == "cuda":
        torch.cuda.set_device(rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo" if args["device"] == "cpu" else "nccl",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    torch.set_num_threads(1)
    device = torch.device(args["device"], rank if args["device"] == "cuda" else None)
    from torch.nn.parallel import DistributedDataParallel

    from rayacc.engine import DDP, FSDP, AccumulationStep, count_target_tokens, token_item_losses
    from rayacc.engine.parallel import ModelRecipe
    from rayacc.engine.recompute import apply_activation_checkpointing
    from rayacc.models.gpt import GPT

    torch.manual_seed(0)
    vocab, seq = args["vocab"], args["seq"]
    model = GPT(vocab, seq, args["layers"], args["heads"], args["width"]).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if args["recompute"] == "full":
        apply_activation_checkpointing(model.blocks)
    if args["strategy"] == "deepspeed":
        strategy = deepspeed_strategy(args["grad_sync"], args, model)
        model, opt = strategy.bind_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        held_optimizer = opt.optimizer
    elif args["strategy"] in ("fsdp", "hsdp", "tp"):
        sync, _, offload = args["grad_sync"].partition(" ")
        built = model
        strategy = FSDP(
            sync,
            replicate=2 if args["strategy"] == "hsdp" else 1,
            node=f"node{rank // (world // 2)}",
            offload=offload == "offload",
            tensor_parallel=2 if args["strategy"] == "tp" else 1,
        )
        model = strategy.build(ModelRecipe(build=lambda: built), device)
        opt = held_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False)
    else:
        model = DistributedDataParallel(model)
        opt = held_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False)
        strategy = DDP().adopt(model)
    step = AccumulationStep(model, opt, strategy=strategy)
    # a tensor-parallel group's ranks read the same rows
    gen = torch.Generator().manual_seed(rank // 2 if args["strategy"] == "tp" else rank)

    def micro():
        tokens = torch.randint(0, vocab, (args["micro"], seq + 1), generator=gen).to(device)
        return {"input": tokens[:, :-1], "target": tokens[:, 1:]}

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: (saved.append(t.numel() * t.element_size()), t)[1], lambda t: t
    ):
        strategy.backward(token_item_losses(model, micro()).sum())
    strategy.discard_grads(opt)
    times = []
    for _ in range(3):
        batches = [micro() for _ in range(args["accum"])]
        t = time.perf_counter()
        last = step(batches, token_item_losses, count_target_tokens)
        times.append(time.perf_counter() - t)
    if args["device"] == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    state = [v for s in held_optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    result = {
        "rank": rank,
        "params_total": n_params,
        "param_mb": local_bytes(held_params(model)) / 2**20,
        "optimizer_mb": local_bytes(state) / 2**20,
        "saved_activations_mb": sum(saved) / 2**20,
        "peak_mb": peak,
        "window_s": statistics.median(times[1:]),
        # a window's gradient collectives on this rank (counted by the strategy)
        "comm": f"{last.reduce_scatter_calls} rs, {last.allreduce_calls} ar",
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    # DeepSpeed's threads can abort the interpreter's teardown ("terminate called without an
    # active exception") after the work is saved: leave without it
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--strategies", default="ddp,fsdp,deepspeed", help="which rows (comma-separated)"
    )
    args = parser.parse_args()
    print(
        f"GPT {args.layers} layers × {args.width} wide, vocab {args.vocab}, seq {args.seq}; "
        f"{args.world} ranks ({args.device}), micro {args.micro} × accum {args.accum}"
    )
    print(
        f"{'strategy':9} {'mode':18} {'recompute':9} {'params M':>8} {'param MB':>9} "
        f"{'optim MB':>9} {'saved MB':>9} {'peak MB':>8} {'window s':>9}  collectives"
    )
    for strategy, grad_sync, recompute in SETTINGS:
        if strategy not in args.strategies.split(","):
            continue
        if strategy == "hsdp" and (args.world < 4 or args.world % 2):
            continue
        if strategy == "tp" and args.world % 2:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            spec = dict(vars(args), strategy=strategy, grad_sync=grad_sync, recompute=recompute)
            mp.start_processes(
                rank_body,
                args=(args.world, os.path.join(tmp, "init"), tmp, spec),
                nprocs=args.world,
                start_method="spawn",
            )
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]
        r = max(ranks, key=lambda x: x["peak_mb"])
        print(
            f"{strategy:9} {grad_sync or '-':18} {recompute:9} {r['params_total'] / 1e6:8.1f} "
            f"{r['param_mb']:9.1f} {r['optimizer_mb']:9.1f} {r['saved_activations_mb']:9.1f} "
            f"{r['peak_mb']:8.0f} {statistics.median(x['window_s'] for x in ranks):9.2f}  "
            f"{r['comm']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
