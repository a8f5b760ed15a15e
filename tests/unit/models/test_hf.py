"""Hugging Face models in and out, with a tiny config built here (nothing fetched): an `hf`
model builds from a config mapping or file, deterministic from the seed, its decoder layers its
blocks; a checkpoint of an `hf` or `gpt` model exports to a folder `transformers` loads with
`from_pretrained`, whose logits equal `rayacc.load_model`'s; what cannot export says so."""

from __future__ import annotations

import json
from fnmatch import fnmatch

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM

from rayacc import load_model
from rayacc.checkpoint import write_checkpoint
from rayacc.config import TrainConfig
from rayacc.data.vocab import VOCAB_FILE, Vocabulary
from rayacc.models import build_model
from tests.support.data.tokens import gpt_checkpoint, token_data
from tests.support.models.hf_configs import tiny_llama
from tests.support.services.cli import rayacc_here

LLAMA = tiny_llama(vocab_size=300)


def hf_cfg(config) -> TrainConfig:
    return TrainConfig.model_validate(
        {"seed": 4, "model": {"name": "hf", "hf": {"config": config}}, "data": {"seq_len": 8}}
    )


def hf_checkpoint(folder, info):
    cfg = hf_cfg(LLAMA)
    model = build_model(cfg, info)
    write_checkpoint(
        folder,
        state={"train_state": {}, "model": model.state_dict()},
        description={"config": cfg.model_dump(mode="json"), "dataset": info.to_dict()},
        meta={"optimizer_step": 3, "shards": None},
        files={VOCAB_FILE: Vocabulary.of_data(info).to_json()},
    )
    return model


@pytest.fixture
def info(tmp_path):
    return token_data(tmp_path, "ids")


def test_an_hf_model_from_a_mapping_or_its_file_is_the_same_and_seeded(tmp_path, info):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(LLAMA))
    a = build_model(hf_cfg(LLAMA), info)
    b = build_model(hf_cfg(str(tmp_path / "cfg")), info)
    c = build_model(hf_cfg(str(tmp_path / "cfg" / "config.json")), info)
    for other in (b, c):
        assert all(
            torch.equal(x, y) for x, y in zip(a.state_dict().values(), other.state_dict().values())
        )
    assert [type(m).__name__ for m in a.fsdp_blocks()] == ["LlamaDecoderLayer"] * 2
    x = torch.tensor([[1, 2, 3, 4]])
    assert a(x).shape == (1, 4, LLAMA["vocab_size"])


def test_what_an_hf_config_cannot_be_is_named(tmp_path, info):
    from rayacc.models.errors import ModelError

    with pytest.raises(ModelError, match="vocab_size=8 is smaller"):
        build_model(hf_cfg({**LLAMA, "vocab_size": 8}), info)
    with pytest.raises(ModelError, match="not a type transformers ships"):
        build_model(hf_cfg({**LLAMA, "model_type": "my-own"}), info)
    with pytest.raises(ModelError, match="no config.json there"):
        build_model(hf_cfg(str(tmp_path / "nowhere")), info)


@pytest.mark.parametrize("kind", ["hf", "gpt"])
def test_an_export_loads_in_transformers_with_equal_logits(
    tmp_path, info, capsys, monkeypatch, kind
):
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "ckpt"
    (hf_checkpoint if kind == "hf" else lambda f, i: gpt_checkpoint(f, i, sharded=False))(
        ckpt, info
    )
    out = tmp_path / "out"
    ran = rayacc_here(["export", str(ckpt), "--out", str(out)], capsys, monkeypatch)
    assert ran.code == 0, ran
    assert "from_pretrained" in ran.out
    theirs = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    ours = load_model(ckpt)
    x = torch.tensor([[1, 5, 2, 7, 3, 0, 4]])
    with torch.no_grad():
        assert torch.allclose(theirs(input_ids=x).logits, ours(x), atol=1e-5)


def test_safetensors_for_any_model_and_hf_refused_where_there_is_no_counterpart(
    tmp_path, capsys, monkeypatch
):
    from safetensors.torch import load_file

    from rayacc.data.sources import DatasetInfo

    ckpt = tmp_path / "ckpt"
    info = DatasetInfo(str(tmp_path / "d.parquet"), "classification", 10, 4, 3)
    cfg = TrainConfig.model_validate({"model": {"name": "mlp", "hidden_sizes": [8]}})
    model = build_model(cfg, info)
    write_checkpoint(
        ckpt,
        state={"train_state": {}, "model": model.state_dict()},
        description={"config": cfg.model_dump(mode="json"), "dataset": info.to_dict()},
        meta={"optimizer_step": 1, "shards": None},
    )
    refused = rayacc_here(["export", str(ckpt), "--out", str(tmp_path / "a")], capsys, monkeypatch)
    assert refused.code == 2 and "--format safetensors" in refused.err, refused
    assert not (tmp_path / "a").exists(), "nothing half-written"
    ran = rayacc_here(
        ["export", str(ckpt), "--out", str(tmp_path / "b"), "--format", "safetensors"],
        capsys,
        monkeypatch,
    )
    assert ran.code == 0, ran
    saved = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    # an existing folder with files is never written into
    again = rayacc_here(
        ["export", str(ckpt), "--out", str(tmp_path / "b"), "--format", "safetensors"],
        capsys,
        monkeypatch,
    )
    assert again.code == 2 and "not an empty folder" in again.err


def _weights_cfg(weights) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "seed": 4,
            "model": {"name": "hf", "hf": {"config": LLAMA, "weights": str(weights)}},
            "data": {"seq_len": 8},
        }
    )


def test_weights_from_a_save_pretrained_folder_are_those_weights_on_the_driver_and_ranks(
    tmp_path, info
):
    """`model.hf.weights` builds the model from exactly those weights, and the driver's
    shapes-only build of it (parameters on the meta device) builds too."""
    from rayacc.models import build_on_meta

    source = build_model(hf_cfg(LLAMA), info)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.5)
    source.hf.save_pretrained(str(tmp_path / "saved"))
    built = build_model(_weights_cfg(tmp_path / "saved"), info)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(),
                                                 built.state_dict().values()))  # fmt: skip
    (tmp_path / "saved" / "generation_config.json").unlink()  # a folder written without one
    again = build_model(_weights_cfg(tmp_path / "saved"), info)
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(),
                                                 again.state_dict().values()))  # fmt: skip
    shapes = build_on_meta(_weights_cfg(tmp_path / "saved"), info)
    assert {k: v.shape for k, v in shapes.state_dict().items()} == {
        k: v.shape for k, v in source.state_dict().items()
    }


def test_weights_transformers_cannot_or_must_not_read_are_refused_naming_field_and_file(
    tmp_path, info
):
    """A folder with only a pickle (`pytorch_model.bin`), a `model.safetensors` that is really a
    pickle (never unpickled), a header cut short: the one error, naming model.hf.weights and
    the file, before transformers meets it."""
    import pickle

    from rayacc.models.errors import ModelError
    from tests.support.data.strangers import Payload

    marker = tmp_path / "ran"
    source = build_model(hf_cfg(LLAMA), info)
    source.hf.save_pretrained(str(tmp_path / "good"))
    cases = {}
    only_bin = tmp_path / "only-bin"
    only_bin.mkdir()
    (only_bin / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(str(marker))))
    cases["pytorch_model.bin"] = only_bin
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "model.safetensors").write_bytes(pickle.dumps(Payload(str(marker))))
    cases["model.safetensors"] = fake
    cut = tmp_path / "cut"
    cut.mkdir()
    data = (tmp_path / "good" / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:200])
    cases["cut"] = cut
    for named, folder in cases.items():
        with pytest.raises(ModelError) as refused:
            build_model(_weights_cfg(folder), info)
        said = str(refused.value)
        assert "model.hf.weights" in said and "Fix:" in said, said
        assert named in said or "model.safetensors" in said, said
    assert not marker.exists(), "a pickle was unpickled"


@pytest.mark.parametrize("kind", ["chars", "bytes", "tokenizer", "ids"])
def test_an_export_carries_the_runs_tokenizer_which_encodes_as_the_run_did(
    tmp_path, capsys, monkeypatch, kind
):
    """`AutoTokenizer.from_pretrained(export)` returned an empty tokenizer: the export now
    writes the run's own (its tokenizer.json, or one made from its characters or bytes), or
    says there is none (a run on bare token ids)."""
    from transformers import AutoTokenizer

    from rayacc.data.vocab import Vocabulary

    data = token_data(tmp_path, kind)
    ckpt = tmp_path / "ckpt"
    gpt_checkpoint(ckpt, data, sharded=False)
    out = tmp_path / "out"
    ran = rayacc_here(["export", str(ckpt), "--out", str(out)], capsys, monkeypatch)
    assert ran.code == 0, ran
    vocabulary = Vocabulary.of_data(data)
    if kind == "ids":
        assert "no tokenizer" in ran.out and not (out / "tokenizer.json").exists()
        return
    assert "the run's tokenizer" in ran.out, ran.out
    theirs = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    prompt = "To be, or not\nto be" if kind != "chars" else vocabulary.chars[:12] * 2
    ids = vocabulary.encode(prompt)
    assert theirs.encode(prompt, add_special_tokens=False) == ids
    assert theirs.decode(ids) == vocabulary.decode(ids)


@pytest.mark.parametrize(
    ("model_type", "refused"),
    [("llama", None), ("gpt2", "declares no tensor-parallel plan"),
     ("gpt_neox", "embedding_rowwise"), ("phi3", "colwise_gather_output")],
)  # fmt: skip
def test_the_tensor_parallel_plan_is_the_one_transformers_declares(info, model_type, refused):
    """An architecture's `base_model_tp_plan`, its paths under the wrapper; one without a plan,
    or with a style rayacc does not apply, refused by name. The built-in GPT declares its own;
    a model that declares none is named."""
    from torch import nn

    from rayacc.engine.parallel.tensor import tp_plan
    from rayacc.models import ModelError
    from rayacc.models.hf import HFCausalLM

    config = AutoConfig.for_model(model_type, **SMALL.get(model_type, {}))
    wrapped = HFCausalLM(AutoModelForCausalLM.from_config(config))
    if refused is None:
        plan = tp_plan(wrapped)
        assert plan and set(plan) == {f"hf.model.{k}" for k in config.base_model_tp_plan}
        # every path names modules of the model
        names = [n for n, _ in wrapped.named_modules()]
        assert all(any(fnmatch(n, key) for n in names) for key in plan), plan
    else:
        with pytest.raises(ModelError, match=refused) as err:
            tp_plan(wrapped)
        assert repr(model_type) in str(err.value)
    gpt = build_model(TrainConfig.model_validate({"model": {"name": "gpt"}}), info)
    assert set(tp_plan(gpt)) == {"blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.0",
                                 "blocks.*.mlp.2"}  # fmt: skip
    with pytest.raises(ValueError, match="Sequential declares no tensor-parallel plan"):
        tp_plan(nn.Sequential(nn.Linear(2, 2)))


SMALL = {
    "llama": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32},
    "gpt2": {"n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 32},
    "gpt_neox": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "vocab_size": 32, "pad_token_id": 0},
    "phi3": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32,
             "pad_token_id": 0},
}  # fmt: skip
