"""Compute precision: the autocast dtype of each `train.precision`, in one place."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["PRECISIONS", "autocast", "autocast_dtype"]

PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast computes in for `precision`; None for fp32 (no autocast)."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    return _AUTOCAST_DTYPES.get(precision)


def autocast(device_type: str, precision: str) -> contextlib.AbstractContextManager[None]:
    """Autocast to `precision`'s dtype on `device_type`, or nothing for fp32."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
