"""FLOPs and MFU: the GPT's training FLOPs per token against a hand count (PaLM's 6N + 12·L·H·Q·T),
the device peaks by name and precision, and MFU as TFLOP/s over that peak."""

from __future__ import annotations

import pytest
import torch

from rayacc.engine.perf import StepCost, device_peak_tflops, known_peak
from rayacc.engine.recompute import apply_activation_checkpointing
from rayacc.models.gpt import GPT


def test_the_gpt_s_flops_per_token_are_the_hand_count():
    # vocabulary 17, context 8, 2 layers, 2 heads, width 16 (head size 8)
    d, vocab, ctx, layers, heads = 16, 17, 8, 2, 2
    norms, attention, mlp = 2 * (2 * d), (d * 3 * d + 3 * d) + (d * d + d), 2 * (4 * d * d) + 5 * d
    block = norms + attention + mlp
    params = vocab * d + ctx * d + layers * block + 2 * d  # the head is tied to the embedding
    assert params == 6992
    model = GPT(vocab, ctx, n_layer=layers, n_head=heads, n_embd=d)
    assert sum(p.numel() for p in model.parameters()) == params
    head_size = d // heads
    for seq in (8, 5):
        want = 6 * params + 12 * layers * heads * head_size * seq
        assert model.flops_per_item((4, seq)) == want
    assert model.flops_per_item() == 6 * 6992 + 12 * 2 * 2 * 8 * 8
    # activation checkpointing: each recomputed block's forward again, hardware FLOPs only
    assert model.recompute_flops_per_item((4, 8)) == 0
    forward = 2 * block + 4 * heads * head_size * 8  # one block's forward per token
    for every_n, recomputed in ((2, 1), (1, 2)):
        fresh = GPT(vocab, ctx, n_layer=layers, n_head=heads, n_embd=d)
        assert apply_activation_checkpointing(fresh.blocks, every_n) == recomputed
        assert fresh.recompute_flops_per_item((4, 8)) == recomputed * forward
        assert fresh.flops_per_item((4, 8)) == model.flops_per_item((4, 8))  # MFU unchanged


@pytest.mark.parametrize(
    "name, precision, tf32, peak",
    [
        ("NVIDIA H200", "bf16", False, 989.0),
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989.0),
        ("NVIDIA H100 80GB HBM3", "fp32", False, 67.0),
        ("NVIDIA H100 80GB HBM3", "fp32", True, 494.0),
        ("NVIDIA H100 PCIe", "bf16", False, 756.0),
        ("NVIDIA A100-SXM4-80GB", "fp16", False, 312.0),
        ("NVIDIA A100-SXM4-40GB", "fp32", False, 19.5),
        ("NVIDIA L4", "bf16", False, 121.0),
        ("NVIDIA L4", "fp32", False, 30.3),
        ("NVIDIA A10G", "bf16", False, 70.0),
        # another model whose name holds a known one's letters is not that one
        ("NVIDIA L40S", "bf16", False, None),
        ("NVIDIA GeForce RTX 4090", "bf16", False, None),
    ],
)
def test_a_device_s_peak_by_its_name_and_the_run_s_precision(name, precision, tf32, peak):
    assert known_peak(name, precision, tf32) == peak


def test_a_configured_peak_wins_and_a_cpu_has_none_without_one():
    cpu = torch.device("cpu")
    assert device_peak_tflops(cpu) is None
    assert device_peak_tflops(cpu, 0.5, "fp32") == 0.5


def test_hfu_counts_the_recompute_and_mfu_does_not():
    cost = StepCost(
        2.0, 0.0, 3, 2, flops_per_item=1e12, peak_tflops=1.5, recompute_flops_per_item=2.5e11
    )
    m = cost.metrics(token_items=True)
    assert m["perf/mfu"] == pytest.approx(0.5)
    assert m["perf/hardware_tflops"] == pytest.approx(0.75 * 1.25)
    assert m["perf/hfu"] == pytest.approx(0.625)
    plain = StepCost(2.0, 0.0, 3, 2, flops_per_item=1e12, peak_tflops=1.5).metrics(True)
    assert "perf/hfu" not in plain and "perf/hardware_tflops" not in plain


def test_mfu_is_the_achieved_tflops_per_device_over_the_peak():
    # 1e12 FLOPs per item × 3 items in 2 s over 2 devices: 0.75 TFLOP/s each
    cost = StepCost(wall_s=2.0, data_s=0.0, items=3, world_size=2, flops_per_item=1e12)
    assert cost.metrics(token_items=True)["perf/tflops"] == pytest.approx(0.75)
    assert "perf/mfu" not in cost.metrics(token_items=True)
    with_peak = StepCost(2.0, 0.0, 3, 2, flops_per_item=1e12, peak_tflops=1.5)
    assert with_peak.metrics(token_items=True)["perf/mfu"] == pytest.approx(0.5)
