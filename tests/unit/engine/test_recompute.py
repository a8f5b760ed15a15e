"""Activation checkpointing: the same step, fewer saved activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayacc.engine.recompute import apply_activation_checkpointing, checkpointed_blocks
from rayacc.models.gpt import GPT


def step(every_n: int | None) -> tuple[int, torch.Tensor, list[str]]:
    """(bytes autograd saved for backward, the gradients, parameter names) of one GPT
    forward + backward, with every `every_n`-th block recomputed (None: none)."""
    torch.manual_seed(0)
    model = GPT(64, 32, n_layer=4, n_head=2, n_embd=64)
    if every_n:
        apply_activation_checkpointing(model.blocks, every_n)
    tokens = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return sum(saved), grads, [n for n, _ in model.named_parameters()]


def test_recomputed_blocks_give_the_same_gradients_and_save_less():
    plain, g_plain, names = step(None)
    half, g_half, names_half = step(2)
    full, g_full, names_full = step(1)
    assert names == names_half == names_full, "checkpoints keep their parameter names"
    torch.testing.assert_close(g_half, g_plain, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_full, g_plain, rtol=1e-5, atol=1e-7)
    assert full < half < plain, (full, half, plain)
    # the blocks hold most of the activations: recomputing all of them saves most of it
    assert full < 0.5 * plain, (full, plain)


def test_every_n_picks_every_nth_block():
    blocks = [torch.nn.Linear(1, 1) for _ in range(5)]
    assert checkpointed_blocks(blocks, 2) == [blocks[0], blocks[2], blocks[4]]
    assert checkpointed_blocks(blocks, 1) == blocks


def test_plan_estimates_activations_near_what_autograd_saves():
    """`rayacc plan --memory`'s activation model against autograd's saved bytes for the GPT of
    `step` (8 sequences of 32): close without recomputation, an upper bound with it (it also
    counts the block recomputed during backward)."""
    from rayacc import TrainConfig
    from rayacc.data.sources import DatasetInfo
    from rayacc.run.quantities import _activations_per_sample

    info = DatasetInfo("x", "tokens", 100, vocab_size=64, max_tokens=33)

    def estimate(setting) -> float:
        cfg = TrainConfig.from_dict(
            {
                "model": {"name": "gpt", "n_layer": 4, "n_head": 2, "n_embd": 64, "block_size": 32},
                "data": {"seq_len": 32},
                "batch": {"global_batch_size": 8},
                "train": {"activation_checkpointing": setting, "loss_chunk_tokens": None},
            }
        )
        return 8 * _activations_per_sample(cfg, info)

    plain, _, _ = step(None)
    full, _, _ = step(1)
    assert abs(estimate("none") - plain) <= 0.1 * plain, (estimate("none"), plain)
    assert full <= estimate("full") < estimate({"every_n": 2}) < estimate("none")
