"""A chat fine-tune's export as the field loads it: the tokenizer the data was rendered with
(its chat template, special tokens and a pad token), special ids inside the vocabulary in the
config and the generation config, and `generate()` stopping on the template's end of turn —
for the built-in GPT (as GPT-2) and a transformers Llama."""

from __future__ import annotations

import json

import pytest
import torch

from rayacc import TrainConfig
from rayacc.checkpoint import write_checkpoint
from rayacc.data.bundled import CHAT_TEMPLATE, chat_tokenizer
from rayacc.data.instruct import prepare_instructions
from rayacc.data.sources import describe_dataset
from rayacc.data.vocab import VOCAB_FILE, Vocabulary
from rayacc.driver.export import export_model
from rayacc.models import build_model
from tests.support.models.hf_configs import tiny_llama

transformers = pytest.importorskip("transformers")

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
]
MODELS = {
    "gpt": {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 64},
    "hf": {"name": "hf", "hf": {"config": {**tiny_llama(vocab_size=261),
                                           "max_position_embeddings": 64}}},
}  # fmt: skip


def _chat_run(tmp_path, kind: str):
    """A checkpoint of a model on chat data prepared with the bundled chat tokenizer."""
    tokenizer = chat_tokenizer(tmp_path / "tokenizer")
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(4)))
    prepare_instructions([str(src)], str(tmp_path / "data"), seq_len=60,
                         tokenizer=str(tokenizer), progress=lambda line: None)  # fmt: skip
    info = describe_dataset(str(tmp_path / "data"))
    cfg = TrainConfig.model_validate({"seed": 2, "model": MODELS[kind]})
    model = build_model(cfg, info)
    write_checkpoint(
        tmp_path / "ckpt",
        state={"train_state": {}, "model": model.state_dict()},
        description={"config": cfg.model_dump(mode="json"), "dataset": info.to_dict()},
        meta={"optimizer_step": 3, "shards": None},
        files={VOCAB_FILE: Vocabulary.of_data(info).to_json()},
    )
    return tokenizer, info


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_chat_fine_tunes_export_renders_its_template_and_stops_on_its_end_of_turn(tmp_path, kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

    source, info = _chat_run(tmp_path, kind)
    export_model(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    original = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    assert theirs.chat_template == CHAT_TEMPLATE
    text = theirs.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=False)
    assert text == original.apply_chat_template(CHAT[:2], add_generation_prompt=True,
                                                tokenize=False)  # fmt: skip
    prompt = theirs(text, add_special_tokens=False)["input_ids"]
    assert prompt == original(text, add_special_tokens=False)["input_ids"]
    assert (theirs.eos_token, theirs.pad_token) == ("<|endoftext|>", "<|endoftext|>")
    end = theirs.convert_tokens_to_ids("<|end|>")

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    vocab = model.get_input_embeddings().num_embeddings
    assert vocab == info.vocab_size
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    for source_of in (config, generation):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids = source_of.get(key)
            for i in ids if isinstance(ids, list) else [ids]:
                assert i is None or 0 <= i < vocab, (key, i, vocab)  # inside the vocabulary
    assert generation["eos_token_id"] == [theirs.eos_token_id, end]
    assert config["pad_token_id"] == theirs.pad_token_id

    class EndsAfterTwo(LogitsProcessor):
        """Makes the model answer two tokens, then the end of turn (a trained chat model's
        way): generation must stop there, not run on to max_new_tokens."""

        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, -torch.inf)
            step = input_ids.shape[1] - len(prompt)
            forced[:, end if step == 2 else ord("a")] = 0.0
            return forced

    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                         logits_processor=[EndsAfterTwo()])  # fmt: skip
    assert out.shape[1] == len(prompt) + 3 and int(out[0, -1]) == end, out


def test_a_gpt_export_without_a_tokenizer_names_no_id_outside_its_vocabulary(tmp_path):
    """GPT-2's own ids (50256) were written into a 500-id model's config: transformers warned
    and generation never stopped. With no tokenizer recorded, none is named."""
    from tests.support.data.tokens import gpt_checkpoint, token_data

    info = token_data(tmp_path, "ids")
    gpt_checkpoint(tmp_path / "ckpt", info, sharded=False)
    export_model(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id"):
        assert config.get(key) is None and generation.get(key) is None, (key, config, generation)
