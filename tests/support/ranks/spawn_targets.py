"""Rank bodies for the spawn helper's own test (they must be importable by spawned processes)."""

from __future__ import annotations

import atexit
import os

import torch


def saves_then_aborts_at_exit(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Saves its result, then leaves a handler that aborts the process in the interpreter's
    teardown: a stand-in for a C++ thread still joinable when its owner is destroyed."""
    torch.save({"rank": rank}, f"{out_dir}/rank{rank}.pt")
    atexit.register(os.abort)


def aborts_before_saving(rank: int, world: int, init_file: str, out_dir: str) -> None:
    if rank == 1:
        os.abort()
    torch.save({"rank": rank}, f"{out_dir}/rank{rank}.pt")
