"""LoRA adapters (`model.lora`) and the user's objective (`train.loss`) in one process: what
trains, how adapters start (the same built whole or materialised by name), what a checkpoint
keeps of a frozen base, what the config refuses, and every wrong return of an objective named."""

from __future__ import annotations

import json
import re

import pytest
import torch

from rayacc.config import ConfigError, TrainConfig
from rayacc.data.sources import DatasetInfo
from rayacc.engine import IGNORE_INDEX
from rayacc.engine.parallel.state import WholeState
from rayacc.engine.units import frozen_names
from rayacc.models import ModelError, build_model
from rayacc.models.init import initial_values
from rayacc.models.objective import Objective
from rayacc.models.registry import build_on_meta, loss_functions

pytest.importorskip("peft")

INFO = DatasetInfo(path="t.parquet", format="tokens", num_rows=8, vocab_size=16, max_tokens=17)
GPT = {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16}


def cfg(**model) -> TrainConfig:
    return TrainConfig.model_validate({"seed": 3, "model": {**GPT, **model}})


def test_only_the_adapters_train_and_the_adapted_model_starts_as_its_base():
    adapted, base = build_model(cfg(lora={"r": 4}), INFO), build_model(cfg(), INFO)
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[3] for n in trainable} == {"qkv", "proj"}  # gpt's default targets
    x = torch.randint(0, 16, (2, 9))
    assert torch.equal(adapted(x), base(x))
    # the base's weights are the same values under their wrapped names
    wrapped = {n.replace(".base_layer.", "."): p for n, p in adapted.named_parameters()}
    for name, p in base.named_parameters():
        assert torch.equal(wrapped[name], p), name


def test_a_sharded_start_materialises_the_same_adapters_by_name():
    built = build_model(cfg(lora={"r": 4, "target_modules": ["qkv", "mlp.0"]}), INFO)
    meta = build_on_meta(cfg(lora={"r": 4, "target_modules": ["qkv", "mlp.0"]}), INFO)
    assert all(p.is_meta for p in meta.parameters())
    value = initial_values(meta, 3)
    for name, p in built.named_parameters():
        assert torch.equal(value(name, p.shape), p.detach()), name


def test_a_checkpoint_keeps_the_adapters_not_the_frozen_base(tmp_path):
    model = build_model(cfg(lora={"r": 4}), INFO)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    whole, _ = WholeState().save(model, optimizer, tmp_path, 0)
    assert set(whole["model"]).isdisjoint(frozen_names(model))
    assert any(".lora_A." in k for k in whole["model"])
    fresh = build_model(cfg(lora={"r": 4}), INFO)
    fresh_opt = torch.optim.SGD([p for p in fresh.parameters() if p.requires_grad], lr=0.1)
    WholeState().load(fresh, fresh_opt, tmp_path, whole)
    x = torch.randint(0, 16, (2, 9))
    assert torch.equal(fresh(x), model(x))
    # an adapter missing from what is loaded is refused, not left at its start
    short = {k: v for k, v in whole["model"].items() if ".lora_B." not in k}
    with pytest.raises(
        ValueError, match=r"do not fit the model \(missing blocks\.0\.attn\..*lora_B"
    ):
        WholeState().load(fresh, fresh_opt, tmp_path, {**whole, "model": short})


@pytest.mark.parametrize(
    ("sections", "where", "message"),
    [
        ({"model": {"name": "mlp", "lora": {"r": 2}}}, "model.lora", "not the mlp"),
        ({"model": {"name": "factory", "factory": "a:b", "lora": {}}}, "model.lora.target_modules",
         "is empty for a factory's model"),
        ({"model": {**GPT, "lora": {}}, "train": {"strategy": "fsdp", "tensor_parallel": 2},
          "scaling": {"num_workers": 2}}, "model.lora", "tensor-parallel plan"),
        ({"train": {"loss": "a:b", "loss_chunk_tokens": 64}}, "train.loss_chunk_tokens",
         "which train.loss replaces"),
        ({"model": {**GPT, "lora": {"r": 0}}}, "model.lora.r", "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_what_fine_tuning_cannot_be_combined_with_is_named(sections, where, message):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(sections)
    assert where in str(info.value) and message in str(info.value), str(info.value)


def test_unknown_target_modules_are_named():
    with pytest.raises(ModelError, match="model.lora.*Fix: .*model.lora.target_modules|Fix: name"):
        build_model(cfg(lora={"target_modules": ["no_such_layer"]}), INFO)


@pytest.mark.parametrize("model", ["gpt", "hf"])
def test_a_typo_among_targets_is_named_with_the_models_linear_layers(model):
    """Each target must name a layer: one typo beside a real target adapted the real one and
    said nothing (the header listed the typo as adapted)."""
    from tests.support.models.hf_configs import tiny_llama

    real, listed = ("qkv", ["head", "mlp.0", "mlp.2", "proj", "qkv"]) if model == "gpt" else (
        "q_proj", ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj",
                   "up_proj", "v_proj"])  # fmt: skip
    kind = {} if model == "gpt" else {"name": "hf", "hf": {"config": tiny_llama(vocab_size=16)}}
    config = cfg(**kind, lora={"r": 2, "target_modules": [real, "nonexistent"]})
    with pytest.raises(ModelError) as error:
        build_model(config, INFO)
    text = str(error.value)
    assert "'nonexistent' names no layer" in text and repr(real) not in text, text
    assert text.endswith(", ".join(listed)), text
    for build in (build_model, build_on_meta):  # every target real: both builds adapt
        build(cfg(**kind, lora={"r": 2, "target_modules": [real]}), INFO)


BATCH = {"input": torch.randint(0, 16, (2, 5)), "target": torch.randint(0, 16, (2, 5))}
WRONG = [
    ("a tensor", lambda out, b: out.sum(), "not a pair (sum, count)"),
    ("three values", lambda out, b: (out.sum(), 1, 2), "not a pair (sum, count)"),
    ("a vector sum", lambda out, b: (out.sum(-1), 3), "not a one-number floating tensor"),
    ("an int sum", lambda out, b: (3, 3), "not a one-number floating tensor"),
    ("a negative count", lambda out, b: (out.sum(), -1), "not a whole number ≥ 0"),
    ("a fractional count", lambda out, b: (out.sum(), 2.5), "not a whole number ≥ 0"),
    ("a bool count", lambda out, b: (out.sum(), True), "not a whole number ≥ 0"),
    ("a vector count", lambda out, b: (out.sum(), torch.ones(2)), "not a whole number ≥ 0"),
]


@pytest.mark.parametrize(("name", "fn", "message"), WRONG, ids=[w[0] for w in WRONG])
def test_every_wrong_return_of_an_objective_is_named(name, fn, message):
    model = build_model(cfg(), INFO)
    with pytest.raises(ModelError, match=f"train.loss='m:f'.*{re.escape(message)}.*Fix: train"):
        Objective("m:f", fn, "input")(model, BATCH)


def test_an_objective_counts_its_items_or_matches_the_count_made_first():
    model = build_model(cfg(), INFO)
    batch = {**BATCH, "target": BATCH["target"].clone()}
    batch["target"][0, :3] = IGNORE_INDEX
    loss_fn, count = loss_functions(INFO, objective="jobs.objectives:label_smoothed")
    total, counted = loss_fn(model, batch)
    assert counted == 7 and count(batch) == 0 and total.dim() == 0
    # counted first (DeepSpeed's engine, fp16): rayacc's count stands and the objective's must
    # agree; a pair loss counting pairs does not
    loss_fn, count = loss_functions(
        INFO, objective="jobs.objectives:label_smoothed", counts_first=True
    )
    assert loss_fn(model, batch)[1] == 0 and count(batch) == 7
    pairs, _ = loss_functions(INFO, objective="jobs.objectives:pair_margin", counts_first=True)
    with pytest.raises(ModelError, match="counted 1 loss items where rayacc counted 7"):
        pairs(model, batch)
    with pytest.raises(ModelError, match="train.loss='tests.support:nope'.*no callable 'nope'"):
        loss_functions(INFO, objective="tests.support:nope")


def test_an_objectives_error_in_a_rank_reaches_the_driver_as_raised():
    """A wrong return found by a rank is the user's error on the driver (exit 2), as the
    driver finds it inside Ray Train's failure."""
    from ray.exceptions import RayTaskError
    from ray.train.v2.api.exceptions import WorkerGroupError

    from rayacc.worker.checkpoint import NoCheckpointLoads, raised_by_ranks

    wrong = ModelError("train.loss='m:f' returned a tensor …, not a pair (sum, count)")
    failure = WorkerGroupError("rank 1 failed", {1: RayTaskError("train_fn", "…", wrong)})
    found = raised_by_ranks(failure, (NoCheckpointLoads, ModelError))
    assert isinstance(found, ModelError) and "not a pair" in str(found)


def test_the_memory_estimate_counts_gradients_and_optimizer_state_of_what_trains():
    from rayacc.run.quantities import memory_per_rank

    config = TrainConfig.model_validate({"model": GPT, "optim": {"name": "adamw"}})
    whole = memory_per_rank(config, INFO, 1000, 2)
    adapted = memory_per_rank(config, INFO, 1000, 2, trainable=100)
    for (label, p, g, o, a), (_, p2, g2, o2, a2) in zip(whole, adapted, strict=True):
        assert (p2, a2) == (p, a), label
        assert (g2, o2) == (pytest.approx(g / 10), pytest.approx(o / 10)), label


def test_a_base_from_weights_is_in_the_runs_identity_by_its_files(tmp_path):
    """An adapter is trained on one base: its files' sha256 is what a resume must match (the
    same path with other weights is another base)."""
    from rayacc.models.lora import BASE_KEY
    from rayacc.run.quantities import run_identity
    from tests.support.models.hf_configs import tiny_llama

    transformers = pytest.importorskip("transformers")
    values = {k: v for k, v in tiny_llama(vocab_size=16).items() if k != "model_type"}
    config = transformers.LlamaConfig(**values)
    weights = tmp_path / "base"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(weights))
    lora_cfg = TrainConfig.model_validate(
        {"model": {"name": "hf", "hf": {"weights": str(weights)}, "lora": {"r": 2}}}
    )
    first = run_identity(lora_cfg, INFO)[BASE_KEY]
    assert first == run_identity(lora_cfg, INFO)[BASE_KEY]
    with open(next(weights.glob("*.safetensors")), "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    assert run_identity(lora_cfg, INFO)[BASE_KEY] != first
    plain = lora_cfg.model_copy(update={"model": lora_cfg.model.model_copy(update={"lora": None})})
    assert BASE_KEY not in run_identity(plain, INFO)


def test_adapters_over_given_weights_read_back_only_on_the_base_named(tmp_path, capsys):
    """A LoRA run over `model.hf.weights` keeps the adapters only: reading it back takes the
    base from `--base DIR`, checked against the run's record of its files; its peft export
    names that base and loads in `AutoPeftModelForCausalLM` with the reader's logits."""
    transformers = pytest.importorskip("transformers")
    from peft import AutoPeftModelForCausalLM

    from rayacc import load_model
    from rayacc.checkpoint.reader import CheckpointError
    from rayacc.cli import main
    from rayacc.driver.export import export_model
    from rayacc.models.lora import BASE_KEY
    from rayacc.run.quantities import run_identity
    from tests.support.models.hf_configs import tiny_llama
    from tests.support.models.lora_checkpoint import lora_checkpoint

    mapping = tiny_llama(vocab_size=16)
    values = {k: v for k, v in mapping.items() if k != "model_type"}
    weights, other = tmp_path / "base", tmp_path / "other"
    for seed, folder in ((1, weights), (2, other)):
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**values)).save_pretrained(folder)
    config = TrainConfig.model_validate(
        {"seed": 4, "model": {"name": "hf", "hf": {"config": mapping, "weights": str(weights)},
                              "lora": {"r": 2}}}
    )  # fmt: skip
    trained, checkpoint = lora_checkpoint(
        tmp_path / "checkpoint", config, INFO, meta={"identity": run_identity(config, INFO)}
    )
    assert BASE_KEY in run_identity(config, INFO)
    with pytest.raises(CheckpointError, match="which its checkpoints do not hold.*--base DIR"):
        load_model(checkpoint)
    with pytest.raises(CheckpointError, match="not the base the adapters .* were trained on"):
        load_model(checkpoint, base=str(other))
    x = torch.randint(0, 16, (2, 7))
    with torch.no_grad():
        expected = trained(x)
        assert torch.equal(load_model(checkpoint, base=str(weights))(x), expected)
    export_model(str(checkpoint), str(tmp_path / "adapter"), fmt="peft", base=str(weights))
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["task_type"]) == (
        str(weights.resolve()),
        "CAUSAL_LM",
    )
    theirs = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.allclose(theirs(input_ids=x).logits, expected, atol=1e-6)
    code = main(["export", str(checkpoint), "--format", "peft", "--out", str(tmp_path / "x")])
    assert code == 2 and "--base DIR" in capsys.readouterr().err


def _packed_and_alone(vocab: int):
    """Three examples alone, and packed into one row with their `documents`."""
    g = torch.Generator().manual_seed(5)
    alone = [torch.randint(0, vocab, (n,), generator=g) for n in (5, 7, 3)]
    row = torch.cat(alone)[None]
    docs = torch.cat([torch.full((len(a),), i) for i, a in enumerate(alone)])[None]
    return alone, row, docs


@pytest.mark.parametrize("kind", ["gpt", "hf sdpa", "hf eager"])
def test_a_packed_row_gives_each_example_its_logits_alone(kind):
    """Each example of a packed row attends to itself only, its positions from 0: the logits
    are those of the example on a row of its own (gpt; a transformers Llama under SDPA and
    eager attention)."""
    from tests.support.models.hf_configs import tiny_llama

    if kind == "gpt":
        model = build_model(cfg(), INFO).eval()
    else:
        config = {**tiny_llama(vocab_size=16), "attn_implementation": kind.split()[1]}
        model = build_model(cfg(name="hf", hf={"config": config}), INFO).eval()
        assert model.hf.config._attn_implementation == kind.split()[1]
    alone, row, docs = _packed_and_alone(16)
    with torch.no_grad():
        packed = model(row, documents=docs)[0]
        each = torch.cat([model(a[None])[0] for a in alone])
        crossed = model(row)[0]
    assert torch.allclose(packed, each, atol=1e-6), (packed - each).abs().max()
    assert not torch.allclose(crossed, each, atol=1e-3), "without documents attention crosses"


def test_a_step_on_packed_rows_is_the_step_on_the_examples_alone():
    """The loss functions hand the model the rows' `documents`: the summed loss and every
    gradient of a packed row equal those of its examples on rows of their own."""
    from rayacc.engine import collate_tokens

    alone, row, docs = _packed_and_alone(16)
    grads = []
    for packed in (True, False):
        model = build_model(cfg(lora={"r": 2}), INFO)
        loss_fn, count = loss_functions(INFO, chunk=None)
        if packed:
            target = row[:, 1:].clone()
            starts = torch.cumsum(torch.tensor([len(a) for a in alone]), 0)[:-1]
            target[0, starts - 1] = IGNORE_INDEX  # no example's first token follows the last
            batch = {"input": row[:, :-1], "target": target, "documents": docs[:, :-1]}
        else:
            batch = collate_tokens(alone)
        loss = loss_fn(model, batch).sum()
        loss.backward()
        grads.append((float(loss), count(batch), [p.grad.clone() for p in model.parameters()
                                                  if p.grad is not None]))  # fmt: skip
    (l1, n1, g1), (l2, n2, g2) = grads
    assert n1 == n2 == sum(len(a) - 1 for a in alone) and l1 == pytest.approx(l2, rel=1e-6)
    for a, b in zip(g1, g2, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
