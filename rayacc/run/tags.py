"""What a fine-tuning run tells its record beside its config: what its loss counts, what
trains, what it trains on."""

from __future__ import annotations

from rayacc.run.spec import RunSpec

__all__ = ["finetune_tags"]


def finetune_tags(
    spec: RunSpec, metadata: dict[bytes, bytes], trainable: int, total: int
) -> dict[str, str]:
    """MLflow tags of a fine-tuning run: what its loss counts (a `loss_mask`'s rule), its
    adapters' trainable parameters and its base (the adapters' config is among the params)."""
    from rayacc.data.common import MASK_RULE_KEY
    from rayacc.models.lora import BASE_KEY

    tags = {}
    if spec.info.loss_mask:
        rule = metadata.get(MASK_RULE_KEY, b"the loss_mask column").decode("utf-8", "replace")
        tags["rayacc.mask_rule"] = rule
    if spec.cfg.model.lora is not None:
        tags["rayacc.trainable_parameters"] = f"{trainable} of {total}"
        m = spec.cfg.model
        base = spec.identity.get(BASE_KEY)
        tags["rayacc.base"] = (
            f"{m.hf.weights} (sha256 {base})"
            if base
            else f"{m.name} built from seed {spec.cfg.seed}"
        )
    if spec.cfg.train.loss is not None:
        tags["rayacc.loss"] = spec.cfg.train.loss
    return tags
