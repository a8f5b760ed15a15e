"""Every export, generated from the definitions: each format (`EXPORT_FORMATS`, `--merge` for
peft) × each model kind × with and without LoRA either reads back, as the format's reader reads
it, as the trained model (its outputs), or is refused by name with a fix — and the fix, run,
reads back as the trained model."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from rayacc import TrainConfig
from rayacc.data.common import DataError
from rayacc.data.sources import DatasetInfo
from rayacc.driver.export import EXPORT_FORMATS, export_model
from rayacc.models import build_model
from tests.support.models.hf_configs import tiny_llama
from tests.support.models.lora_checkpoint import lora_checkpoint

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOKENS = DatasetInfo(path="t.parquet", format="tokens", num_rows=8, vocab_size=16, max_tokens=17)
ROWS = DatasetInfo(path="c.parquet", format="classification", num_rows=8, num_features=4,
                   num_classes=3)  # fmt: skip
MODELS = {
    "mlp": ({"name": "mlp", "hidden_sizes": [8]}, ROWS),
    "gpt": ({"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}, TOKENS),
    "hf": ({"name": "hf", "hf": {"config": tiny_llama(vocab_size=16)}}, TOKENS),
}
CASES = [
    (kind, lora, fmt, merge)
    for kind, lora, (fmt, merge) in itertools.product(
        MODELS, (False, True), [(f, False) for f in EXPORT_FORMATS] + [("peft", True)]
    )
    if not (lora and kind == "mlp")  # refused at config: the mlp has no adapters
]


def _config(kind: str, lora: bool) -> TrainConfig:
    model, _ = MODELS[kind]
    return TrainConfig.model_validate({"seed": 3, "model": {**model, **(
        {"lora": {"r": 2}} if lora else {})}})  # fmt: skip


def _inputs(kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if kind == "mlp":
        return torch.randn(3, 4, generator=gen)
    return torch.randint(0, 16, (2, 7), generator=gen)


def read_back(folder, fmt: str, merge: bool, kind: str, lora: bool):
    """The exported model as the format's reader reads it, as a function of the inputs."""
    cfg = _config(kind, lora)
    if fmt == "safetensors":
        from safetensors.torch import load_file

        plain = build_model(cfg.model_copy(update={"model": cfg.model.model_copy(
            update={"lora": None})}), MODELS[kind][1]).eval()  # fmt: skip
        saved = load_file(str(folder / "model.safetensors"))
        params = dict(plain.named_parameters(remove_duplicate=False))
        shared = {n for n, p in params.items() if sum(q is p for q in params.values()) > 1}
        missing, unexpected = plain.load_state_dict(saved, strict=False)
        assert not unexpected and set(missing) <= shared, (missing, unexpected)
        return plain
    if fmt == "hf" or merge:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
        return lambda x: hf.eval()(input_ids=x).logits
    from peft import AutoPeftModelForCausalLM, PeftModel

    if kind == "gpt":  # its GPT-2 base written beside the adapter, named as its base
        peft = AutoPeftModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    else:  # on the run's base (built from the same config and seed)
        base = build_model(cfg.model_copy(update={"model": cfg.model.model_copy(
            update={"lora": None})}), MODELS[kind][1]).hf  # fmt: skip
        peft = PeftModel.from_pretrained(base, str(folder))
    return lambda x: peft.eval()(input_ids=x).logits


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_an_export_reads_back_as_the_trained_model_or_its_refusals_fix_does(tmp_path, case):
    kind, lora, fmt, merge = case
    cfg = _config(kind, lora)
    trained, checkpoint = lora_checkpoint(tmp_path / "checkpoint", cfg, MODELS[kind][1], std=0.5)
    x = _inputs(kind)
    with torch.no_grad():
        expected = trained.eval()(x)
    try:
        export_model(str(checkpoint), str(tmp_path / "out"), fmt=fmt, merge=merge)
    except DataError as exc:
        fix = re.search(r"Fix: --format (\w+)", str(exc))
        assert fix and fix[1] in EXPORT_FORMATS and fix[1] != fmt, str(exc)
        fmt, merge = fix[1], False
        export_model(str(checkpoint), str(tmp_path / "out"), fmt=fmt)
    model = read_back(tmp_path / "out", fmt, merge, kind, lora)
    with torch.no_grad():
        got = model(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4), (case, fmt)
