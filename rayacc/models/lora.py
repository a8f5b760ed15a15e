"""LoRA adapters through peft (`model.lora`; `pip install 'rayacc[hf]'`): injected into the
model in place (peft's `inject_adapter_in_model`), so the names rayacc shards, checkpoints and
plans by stay the model's own with peft's `base_layer` / `lora_A` / `lora_B` inside. An `hf`
model gets them on its transformers module, so an exported adapter is the one `PeftModel`
loads on that base."""

from __future__ import annotations

import math

import torch
from torch import nn

from rayacc.config.finetune import LoraConfig
from rayacc.models.errors import ModelError

__all__ = [
    "BASE_KEY",
    "GPT_TARGETS",
    "adapter_root",
    "apply_lora",
    "base_identity",
    "base_name",
    "is_adapter",
    "lora_initial_value",
    "peft_config",
    "trainable_count",
]

GPT_TARGETS = ["qkv", "proj"]
"""`gpt`'s attention: the query-key-value projection and the projection back."""


BASE_KEY = "base weights (sha256 of the folder's files)"
"""The run identity's entry of a LoRA run's base weights (checked on resume, and when a
checkpoint is read back with the base the caller names)."""


def base_identity(weights: str) -> str:
    """sha256 over a weights folder's files (names, sizes, contents), read once: an adapter
    is trained on one base, and a base changed in place under the same path is another."""
    import hashlib
    from pathlib import Path

    folder = Path(weights).expanduser()
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        digest.update(f"{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def adapter_root(model: nn.Module) -> nn.Module:
    """The module adapters go on: an `hf` model's transformers module, else the model."""
    return getattr(model, "hf", model)


def peft_config(lora: LoraConfig, model: nn.Module):
    try:
        from peft import LoraConfig as PeftLora
    except ImportError:
        raise ModelError("model.lora needs peft. Fix: pip install 'rayacc[hf]'") from None
    targets = lora.target_modules
    if targets is None:
        root = adapter_root(model)
        if root is model:
            if not any(n.rpartition(".")[2] in GPT_TARGETS for n, _ in model.named_modules()):
                raise ModelError(
                    "model.lora: the model has no layers named "
                    f"{' or '.join(GPT_TARGETS)}. Fix: model.lora.target_modules naming its "
                    "linear layers"
                )
            targets = GPT_TARGETS
    return PeftLora(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets
    )


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """Adapters on `model` in place; every other parameter frozen. Draws the adapters' start
    from the global RNG (the caller seeds it), as peft does."""
    from peft import inject_adapter_in_model

    config = peft_config(lora, model)
    root = adapter_root(model)
    if config.target_modules:  # none given for an `hf` model: peft's for its architecture
        _check_targets(root, sorted(config.target_modules))
    try:
        inject_adapter_in_model(config, root)
    except ValueError as exc:  # a target that matches no layer, a layer peft cannot adapt
        raise ModelError(
            f"model.lora: {str(exc).splitlines()[0][:300]}. Fix: model.lora.target_modules "
            "naming linear layers of the model"
        ) from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def _check_targets(root: nn.Module, targets: list[str]) -> None:
    """Each target names a layer (peft's rule for a list: the name, or its ending after a
    dot): a typo among them would otherwise adapt the rest and say nothing."""
    names = [n for n, _ in root.named_modules() if n]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not unmatched:
        return
    # each linear layer by its ending: its name, or with its parent's where the name is a
    # position in a sequence (gpt's `mlp.0`)
    linear = sorted({".".join(n.split(".")[-2 if n.rpartition(".")[2].isdigit() else -1:])
                     for n, m in root.named_modules() if isinstance(m, nn.Linear)})  # fmt: skip
    raise ModelError(
        f"model.lora.target_modules: {', '.join(map(repr, unmatched))} names no layer of the "
        f"model. Fix: name its linear layers (by name or name ending): {', '.join(linear)}"
    )


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The base parameter's name without the adapter's wrapping (`x.base_layer.weight` →
    `x.weight`): a base starts as it would without adapters."""
    return name.replace(".base_layer.", ".")


def lora_initial_value(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """peft's start of an adapter: A Kaiming-uniform (a = √5, as `nn.Linear`), B zero (the
    adapted model starts as its base)."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=√5) on fan_in
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
