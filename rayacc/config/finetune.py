"""The fine-tuning settings beside the model and the loss: LoRA adapters (`model.lora`) and the
user's objective (`train.loss`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LoraConfig", "finetune_rules"]


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


def finetune_rules(sections: dict) -> list:
    """What `model.lora` and `train.loss` cannot be combined with, as config issues."""
    from rayacc.config.errors import MISSING, ConfigIssue

    model, train = sections.get("model"), sections.get("train")
    issues = []
    lora = getattr(model, "lora", None)
    if lora is not None and model.name == "mlp":
        issues.append(
            ConfigIssue(
                "model.lora",
                "adapts linear layers of gpt, hf or a factory's model, not the mlp",
                MISSING,
                "remove model.lora",
            )
        )
    if lora is not None and model.name == "factory" and not lora.target_modules:
        issues.append(
            ConfigIssue(
                "model.lora.target_modules",
                "is empty for a factory's model",
                None,
                "name the linear layers to adapt (names or name endings)",
            )
        )
    chunk = train is not None and "loss_chunk_tokens" in train.model_fields_set
    if chunk and train.loss is not None and train.loss_chunk_tokens:
        issues.append(
            ConfigIssue(
                "train.loss_chunk_tokens",
                "is rayacc's chunked cross-entropy, which train.loss replaces",
                train.loss_chunk_tokens,
                "remove train.loss_chunk_tokens",
            )
        )
    return issues
