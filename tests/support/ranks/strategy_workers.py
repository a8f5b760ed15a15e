"""Rank bodies for the strategy tests (2 gloo processes, no Ray): a micro-batch search leaves
the model as it found it, for every strategy and sync mode; a user model with a buffer is
materialised whole under FSDP."""

from __future__ import annotations

import functools

import torch
from torch import nn

from tests.support.ranks.engine_helpers import full_weights, token_micro_batches, token_sequences

VOCAB, BLOCK = 16, 16
STRATEGIES = ("ddp", "fsdp every_micro_step", "fsdp window_end")


def gpt_config(strategy: str, dropout: float = 0.1, factory: str | None = None):
    from rayacc.config import TrainConfig

    name, _, grad_sync = strategy.partition(" ")
    model = (
        {"name": "factory", "factory": factory}
        if factory
        else {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": BLOCK}
    )
    return TrainConfig.model_validate(
        {
            "seed": 3,
            "model": {**model, "dropout": dropout},
            "optim": {"name": "sgd", "lr": 0.5, "momentum": 0.0, "weight_decay": 0.0},
            "train": {"strategy": name},
            **({"fsdp": {"grad_sync": grad_sync}} if grad_sync else {}),
        }
    )


def dataset():
    from rayacc.data.sources import DatasetInfo

    return DatasetInfo(
        path="tokens.parquet", format="tokens", num_rows=64, vocab_size=VOCAB, max_tokens=BLOCK + 1
    )


def window(rank: int) -> list[torch.Tensor]:
    seqs = token_sequences(8, seed=40 + rank, min_len=2, max_len=BLOCK + 1)
    return [s.clamp(max=VOCAB - 1) for s in seqs]


def build(cfg):
    from rayacc.engine import token_item_losses
    from rayacc.rank.build import build_rank

    parts = build_rank(cfg, dataset(), torch.device("cpu"), 0.5)
    return parts.strategy, parts.model, parts.accumulate, token_item_losses


def fsdp_internal_grads(model: nn.Module) -> int:
    """Unsharded gradients FSDP holds inside its units (none after a synced backward)."""
    from rayacc.engine.units import is_fsdp

    held = 0
    for module in model.modules():
        if is_fsdp(module):
            group = module._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group is not None else ():
                unsharded = getattr(fp, "_unsharded_param", None)
                held += fp.unsharded_accumulated_grad is not None
                held += unsharded is not None and unsharded.grad is not None
    return held


def search_scenario(rank: int, world: int, out: dict, strategy_name: str) -> None:
    """The first step of a fresh model, with and without an auto search before it."""
    from rayacc.engine import count_target_tokens, find_micro_batch_size
    from rayacc.engine.units import is_fsdp

    cfg = gpt_config(strategy_name)
    seqs = window(rank)
    runs = {}
    for searched in (False, True):
        strategy, model, step, loss_fn = build(cfg)
        torch.manual_seed(100 + rank)
        rng_before = torch.get_rng_state()
        info = {}
        if searched:

            def make_batch(n: int):
                return token_micro_batches([seqs[i % len(seqs)] for i in range(n)], n)[0]

            found = find_micro_batch_size(
                strategy.unwrapped(),
                loss_fn,
                make_batch,
                samples_per_worker=8,
                budget_bytes=2**40,
                strategy=strategy,
            )
            info = {
                "trials": found.trials,
                "rng_kept": torch.equal(rng_before, torch.get_rng_state()),
                "param_grads": sum(p.grad is not None for p in model.parameters()),
                "internal_grads": fsdp_internal_grads(model),
                "sync_on": all(
                    m._get_fsdp_state()._fsdp_param_group.reduce_grads
                    for m in model.modules()
                    if is_fsdp(m) and m._get_fsdp_state()._fsdp_param_group is not None
                ),
            }
        result = step(token_micro_batches(seqs, 2), loss_fn, count_target_tokens)
        runs[searched] = {
            "params": full_weights(strategy.unwrapped()),
            "grad_norm": result.grad_norm,
            "comm": (result.allreduce_calls, result.reduce_scatter_calls, result.sync_passes),
            **info,
        }
    out[strategy_name] = runs


class MaskedLM(nn.Module):
    """A causal LM whose mixing weights are a buffer computed in `__init__` (as nanoGPT's
    causal mask and rotary tables are), and that says how each parameter starts."""

    def __init__(self, vocab: int, block: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, vocab)
        weights = torch.tril(torch.ones(block, block))
        self.register_buffer("mix", weights / weights.sum(1, keepdim=True))

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator):
        if name.endswith("bias"):
            return torch.zeros(shape)
        return torch.empty(shape).normal_(0.0, 0.3, generator=generator)

    def forward(self, idx):
        t = idx.shape[1]
        h = self.mix[:t, :t] @ self.emb(idx)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def masked_lm(dataset, **_):
    return MaskedLM(dataset.vocab_size, BLOCK)


def buffer_scenario(rank: int, world: int, out: dict) -> None:
    from rayacc.engine import count_target_tokens

    cfg = gpt_config("fsdp every_micro_step", dropout=0.0, factory=f"{__name__}:masked_lm")
    strategy, _, step, loss_fn = build(cfg)
    before = full_weights(strategy.unwrapped())
    seqs = window(0) + window(1)
    mine = seqs[rank * 8 : (rank + 1) * 8]
    step(token_micro_batches(mine, 4), loss_fn, count_target_tokens)
    out["buffer"] = {
        "before": before,
        "after": full_weights(strategy.unwrapped()),
        "mix": strategy.unwrapped().mix.clone(),
    }


def hf_weights_scenario(rank: int, world: int, out: dict) -> None:
    """`model.hf.weights` under DDP and FSDP: the first step's loss is transformers' own."""
    from rayacc.config import TrainConfig
    from rayacc.data.sources import DatasetInfo
    from rayacc.rank.build import build_rank
    from tests.support.ranks.engine_helpers import VOCAB as HF_VOCAB
    from tests.support.ranks.engine_helpers import hf_weights_first_step

    info = DatasetInfo("tokens.parquet", "tokens", 64, vocab_size=HF_VOCAB, max_tokens=13)

    def parts(cfg):
        built = build_rank(cfg, info, torch.device("cpu"), 0.5)
        return built.accumulate, built.loss_fn, built.count

    out["hf_weights"] = {}
    for strategy in ("ddp", "fsdp every_micro_step"):
        base = gpt_config(strategy, dropout=0.0).model_dump(mode="json", exclude_unset=True)

        def cfg_of(model, base=base):
            return TrainConfig.model_validate({**base, "model": model})

        out["hf_weights"][strategy] = hf_weights_first_step(cfg_of, parts, rank, world)


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from tests.support.ranks.dist_workers import run_scenarios

    scenarios = [functools.partial(search_scenario, strategy_name=s) for s in STRATEGIES]
    run_scenarios(
        rank, world, init_file, out_dir, [*scenarios, buffer_scenario, hf_weights_scenario]
    )
