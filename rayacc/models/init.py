"""Initial weights as a function of the seed and the parameter's name only.

A model that defines `initial_value(name, shape, generator) -> Tensor` (the built-in `gpt` does;
user factories may) is initialised parameter by parameter, each from a generator of its own
seeded by (seed, name). The weights then do not depend on the order modules are built in, on
the device, or on how many ranks hold them: a sharded run materialises each rank's rows of a
parameter from the same full value (engine/parallel/fsdp_mesh.py::materialize_shards), one
parameter at a time.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

__all__ = ["init_parameters", "initial_values", "parameter_generator", "seeds_parameters"]


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator parameter `name` draws its initial value from."""
    return torch.Generator().manual_seed((int(seed) << 32) ^ zlib.crc32(name.encode()))


def seeds_parameters(model: nn.Module) -> bool:
    """Whether the model says how each parameter starts (`initial_value`)."""
    return callable(getattr(model, "initial_value", None))


def initial_values(model: nn.Module, seed: int):
    """`(name, shape) -> full initial tensor (CPU, float32)` for a model that seeds its
    parameters."""

    from rayacc.models.lora import base_name, is_adapter, lora_initial_value

    def value(name: str, shape: torch.Size) -> torch.Tensor:
        if is_adapter(name):
            return lora_initial_value(name, torch.Size(shape), parameter_generator(seed, name))
        # a base under adapters starts as it does without them
        name = base_name(name)
        out = model.initial_value(name, torch.Size(shape), parameter_generator(seed, name))
        if tuple(out.shape) != tuple(shape):
            raise ValueError(
                f"{type(model).__name__}.initial_value({name!r}) returned shape "
                f"{tuple(out.shape)}, the parameter has {tuple(shape)}"
            )
        return out

    return value


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int) -> None:
    """Writes every parameter's initial value (parameters on the meta device are left alone:
    they get their values when materialised)."""
    value = initial_values(model, seed)
    for name, p in model.named_parameters():
        if not p.is_meta:
            p.copy_(value(name, p.shape))
