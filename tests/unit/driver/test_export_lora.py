"""A LoRA run through every export format, for each model kind: `hf` and `safetensors` hold
the adapted model (the adapters merged: either format's reader would drop them), `peft` the
adapter on the base it names. Each is read back as its reader reads it and gives the trained
model's logits."""

from __future__ import annotations

import pytest
import torch

from rayacc import TrainConfig, load_model
from rayacc.data.sources import DatasetInfo
from rayacc.driver.export import export_model
from rayacc.models import build_model
from tests.support.models.hf_configs import tiny_llama
from tests.support.models.lora_checkpoint import lora_checkpoint

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

INFO = DatasetInfo(path="t.parquet", format="tokens", num_rows=8, vocab_size=16, max_tokens=17)
MODELS = {
    "gpt": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16,
            "lora": {"r": 2, "target_modules": ["qkv", "proj", "mlp.0", "head"]}},
    "hf": {"name": "hf", "hf": {"config": tiny_llama(vocab_size=16)}, "lora": {"r": 2}},
}  # fmt: skip


def _trained(tmp_path, kind: str):
    """A LoRA checkpoint whose adapters moved (lora_B away from its zero start)."""
    config = TrainConfig.model_validate({"seed": 4, "model": MODELS[kind]})
    trained, checkpoint = lora_checkpoint(tmp_path / "checkpoint", config, INFO, std=0.5)
    return config, trained.eval(), checkpoint


@pytest.mark.parametrize("kind", list(MODELS))
def test_every_format_of_a_lora_run_reads_back_as_the_trained_model(tmp_path, kind):
    from safetensors.torch import load_file

    config, trained, checkpoint = _trained(tmp_path, kind)
    x = torch.randint(0, 16, (2, 7))
    with torch.no_grad():
        expected = trained(x)
        base = build_model(config.model_copy(update={"model": config.model.model_copy(
            update={"lora": None})}), INFO).eval()  # fmt: skip
        assert not torch.allclose(base(x), expected, atol=1e-3), "the adapters changed nothing"
        assert torch.allclose(load_model(checkpoint)(x), expected, atol=1e-6)

    done = export_model(str(checkpoint), str(tmp_path / "hf"), fmt="hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), local_files_only=True
    ).eval()
    with torch.no_grad():
        assert torch.allclose(theirs(input_ids=x).logits, expected, rtol=1e-5, atol=1e-4)
    assert "LoRA adapters merged" in done.what

    done = export_model(str(checkpoint), str(tmp_path / "st"), fmt="safetensors")
    assert "LoRA adapters merged" in done.what
    saved = load_file(str(tmp_path / "st" / "model.safetensors"))
    # rayacc's names of the model without adapters; a tied weight is written once, and an
    # adapted head is a head of its own (its delta is not the embedding's)
    params = dict(base.named_parameters(remove_duplicate=False))
    shared = {n for n, p in params.items() if sum(q is p for q in params.values()) > 1}
    if shared <= saved.keys():
        for name in shared:
            parent, _, leaf = name.rpartition(".")
            setattr(base.get_submodule(parent), leaf, torch.nn.Parameter(params[name].clone()))
    missing, unexpected = base.load_state_dict(saved, strict=False)
    assert not unexpected and set(missing) <= shared, (missing, unexpected)
    with torch.no_grad():
        assert torch.allclose(base(x), expected, rtol=1e-5, atol=1e-4)

    export_model(str(checkpoint), str(tmp_path / "merged"), fmt="peft", merge=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), local_files_only=True
    ).eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=x).logits, expected, rtol=1e-5, atol=1e-4)


def test_a_gpt_runs_peft_adapter_loads_on_the_gpt2_written_beside_it(tmp_path):
    """The README's fine-tune gave an adapter no peft user could apply (no base named, rayacc's
    layer names): it now names the GPT-2 written beside it, under GPT-2's names, and
    `AutoPeftModelForCausalLM` loads the run with the trained model's logits."""
    import json

    from peft import AutoPeftModelForCausalLM

    _, trained, checkpoint = _trained(tmp_path, "gpt")
    export_model(str(checkpoint), str(tmp_path / "adapter"), fmt="peft")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "adapter" / "base").resolve())
    assert "transformer.h.0.attn.c_attn" in config["target_modules"], config
    theirs = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    x = torch.randint(0, 16, (2, 7))
    with torch.no_grad():
        assert torch.allclose(theirs(input_ids=x).logits, trained(x), rtol=1e-5, atol=1e-4)
