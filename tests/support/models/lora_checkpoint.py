"""A LoRA run's checkpoint as a run writes it, its adapters moved away from their start."""

from __future__ import annotations

from pathlib import Path

import torch


def lora_checkpoint(folder: Path, config, info, std: float = 1.0, meta: dict | None = None):
    """(the trained model, the checkpoint folder): `config`'s model with every `lora_B` drawn
    from N(0, std²) (it starts at zero: the adapters would change nothing), saved whole."""
    from rayacc.checkpoint import write_checkpoint
    from rayacc.engine.parallel.state import WholeState
    from rayacc.models import build_model

    trained = build_model(config, info)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=std)
    optimizer = torch.optim.SGD([p for p in trained.parameters() if p.requires_grad], lr=0.1)
    whole, _ = WholeState().save(trained, optimizer, folder.parent, 0)
    checkpoint = write_checkpoint(
        folder,
        state={"train_state": {}, **whole},
        description={"config": config.model_dump(mode="json"), "dataset": info.to_dict()},
        meta={"optimizer_step": 1, "shards": None, **(meta or {})},
    )
    return trained, checkpoint
