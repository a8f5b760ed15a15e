"""The fine-tuning settings beside the model and the loss: LoRA adapters (`model.lora`) and the
user's objective (`train.loss`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LoraConfig"]


class LoraConfig(BaseModel):
    """`model.lora`: low-rank adapters (peft's LoRA, `pip install 'rayacc[hf]'`) on the model's
    linear layers; the base is frozen and only the adapters train, are in the optimizer and in
    checkpoints."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )

    r: int = Field(8, ge=1)
    """The adapters' rank."""
    alpha: float = Field(16.0, gt=0.0)
    """The scale: an adapter's update is multiplied by alpha / r (peft's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on an adapter's input (0 keeps accumulation exactly the big batch's step)."""
    target_modules: list[str] | None = None
    """Names (or name endings) of the linear layers that get adapters; null: `gpt`'s attention
    (qkv, proj), or the layers peft lists for an `hf` model's architecture."""
