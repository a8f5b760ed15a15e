"""Every collective goes through rayacc.engine.collectives, which puts tensors on the process
group's device (NCCL takes CUDA tensors only)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rayacc.engine import collectives

PACKAGE = Path(__file__).resolve().parents[3] / "rayacc"
HELPER = PACKAGE / "engine" / "collectives.py"
COLLECTIVES = (
    "all_reduce|all_gather|all_gather_object|all_gather_into_tensor|broadcast|"
    "broadcast_object_list|reduce_scatter|reduce_scatter_tensor|all_to_all|barrier|gather|"
    "gather_object|scatter|scatter_object_list|reduce"
)
CALL = re.compile(rf"\b(?:dist|torch\.distributed)\.({COLLECTIVES})\s*\(")
IMPORT = re.compile(rf"from\s+torch\.distributed\s+import\s+[^\n]*\b({COLLECTIVES})\b")


def test_no_module_calls_a_collective_outside_the_helper():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == HELPER:
            continue
        text = path.read_text()
        for pattern in (CALL, IMPORT):
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {m.group(0)}")
    assert offenders == [], "collectives outside rayacc/engine/collectives.py:\n" + "\n".join(
        offenders
    )


def test_the_helper_puts_tensors_on_the_gpu_for_nccl_and_on_the_cpu_for_gloo(monkeypatch):
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(collectives.torch.cuda, "current_device", lambda: 3)
    assert collectives.group_device() == torch.device("cuda", 3)
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "gloo")
    assert collectives.group_device() == torch.device("cpu")


def test_a_tensor_already_on_the_group_device_is_reduced_in_place(monkeypatch):
    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append(t)
        t.mul_(2)

    original = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    monkeypatch.setattr(collectives, "distributed", lambda group=None: True)
    monkeypatch.setattr(collectives.dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(collectives, "group_device", lambda group=None: torch.device("cpu"))
    out = collectives.all_reduce(original)
    assert out is original and calls == [original] and out.tolist() == [2.0, 4.0, 6.0]


def test_the_gather_helper_refuses_tensors_off_the_group_device(monkeypatch):
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(collectives.torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match="cuda:0"):
        collectives.all_gather_into(torch.zeros(4), torch.zeros(2))


def test_the_buffer_the_window_stats_ride_in_is_kept_for_every_size_it_holds():
    """A group's first window carries no rank figures and every later one does (and a bench
    alternates both): the bucket-sized buffer the stats ride in is made again only when a
    larger one is needed, since each one made costs an allocation the size of the bucket."""
    import torch

    from rayacc.engine.sync import CommCounter

    counter = CommCounter()
    grads = torch.zeros(1000)
    first = counter._riding_buffer(grads, 1006)
    wider = counter._riding_buffer(grads, 1020)
    narrower = counter._riding_buffer(grads, 1006)
    assert [b.numel() for b in (first, wider, narrower)] == [1006, 1020, 1006]
    assert narrower.data_ptr() == wider.data_ptr() and narrower.is_contiguous()
    assert counter._riding_buffer(grads.double(), 1006).dtype == torch.float64
