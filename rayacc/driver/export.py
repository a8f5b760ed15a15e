"""`rayacc export RUN_OR_CHECKPOINT --out DIR`: a checkpoint's weights for the Hugging Face
ecosystem. `--format hf` (default): a folder `transformers` loads with `from_pretrained(DIR)`
(config.json and model.safetensors) — an `hf` model as itself, rayacc's `gpt` as the GPT-2 it is
layer for layer; `--format safetensors`: the model's weights under rayacc's names, for any
model; `--format peft`: a LoRA run's adapter folder (`PeftModel.from_pretrained(base, DIR)`),
with `--merge` the adapters folded into the base, written as `--format hf` writes (`hf` and
`safetensors` write a LoRA run so, merged: either format's reader would drop the adapters). The
checkpoint is read by the one reader (`load_model`: data only, nothing outside its folder);
the folder appears whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rayacc import env

__all__ = ["EXPORT_FORMATS", "Exported", "export_model"]

EXPORT_FORMATS = ("hf", "safetensors", "peft")


@dataclass
class Exported:
    checkpoint: str
    out: Path
    what: str
    """What was written, in a phrase."""
    passed_over: list[str]


def export_model(
    target: str,
    out: str,
    *,
    fmt: str = "hf",
    storage: str | None = None,
    factory: str | None = None,
    merge: bool = False,
    base: str | None = None,
) -> Exported:
    """Writes the weights of RUN_OR_CHECKPOINT `target` to the new folder `out`."""
    from rayacc.checkpoint.reader import load_model
    from rayacc.data.common import DataError
    from rayacc.driver.sample import _local, find_checkpoint

    if fmt not in EXPORT_FORMATS:
        raise DataError(f"--format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    if merge and fmt != "peft":
        raise DataError("--merge folds a LoRA run's adapters into its base. Fix: --format peft")
    dest = Path(out).expanduser()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DataError(
            f"--out {out}: exists and is not an empty folder. Fix: name a new folder (the "
            "export never writes into one that holds files)"
        )
    passed_over: list[str] = []
    checkpoint = find_checkpoint(target, storage, passed_over)
    with tempfile.TemporaryDirectory(prefix="rayacc-export-") as scratch:
        local = _local(checkpoint, scratch)
        model = load_model(local, factory=factory, base=base)
        vocabulary = _vocabulary(local) if fmt in ("hf", "peft") else None
        # a LoRA run's model is its base with the adapters: `hf` and `safetensors` hold it
        # merged (the adapters alone would be dropped by a reader of either), `peft` the adapter
        adapted = _is_lora(model) and fmt != "peft"
        if fmt == "peft" or adapted:
            wrapper, model = model, _as_peft(model, local, base)
            if merge or adapted:
                _untie_adapted(model)
                model, fmt = model.merge_and_unload(), "hf" if fmt == "peft" else fmt
                if hasattr(wrapper, "hf"):  # an `hf` model keeps rayacc's wrapper (its names)
                    wrapper.hf, model = model, wrapper
    dest.parent.mkdir(parents=True, exist_ok=True)
    # written beside the destination, then renamed into place: whole or not at all
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tokenizer = _tokenizer(vocabulary) if fmt in ("hf", "peft") else None
        what = _write(model, staging, fmt, _special_ids(tokenizer, vocabulary), dest)
        if fmt == "peft" and (staging / GPT2_BASE).is_dir():
            what += _write_tokenizer(vocabulary, tokenizer, staging / GPT2_BASE)
        if adapted:
            what += "; its LoRA adapters merged into the base (--format peft: the adapter alone)"
        if fmt == "hf":
            what += _write_tokenizer(vocabulary, tokenizer, staging)
        env.umask_modes(staging)  # for whoever serves it, as any other file here
        if dest.exists():
            dest.rmdir()
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Exported(checkpoint, dest, what, passed_over)


def _write(
    model, folder: Path, fmt: str, special: dict[str, int | None] | None = None,
    final: Path | None = None,
) -> str:  # fmt: skip
    from rayacc.checkpoint.reader import CheckpointError
    from rayacc.data.common import DataError
    from rayacc.models.gpt import GPT
    from rayacc.models.hf import HFCausalLM

    if fmt == "peft":
        if isinstance(model.get_base_model(), GPT):
            return _gpt2_adapter(model, folder, special, final)
        model.save_pretrained(str(folder))
        return "a peft adapter (PeftModel.from_pretrained on the run's base)"
    if fmt == "safetensors":
        from safetensors.torch import save_model

        # shared (tied) weights are written once, as safetensors requires
        save_model(model, str(folder / "model.safetensors"))
        return "model.safetensors (rayacc's parameter names)"
    from transformers import PreTrainedModel

    # an `hf` model, or one its adapters were merged into (peft hands back the inner model)
    inner = model.hf if isinstance(model, HFCausalLM) else model
    if isinstance(inner, PreTrainedModel):
        _set_special(inner, special)
        inner.save_pretrained(str(folder), safe_serialization=True)
        return f"a transformers {type(inner).__name__} (from_pretrained)"
    if isinstance(model, GPT):
        from transformers import GPT2Config, GPT2LMHeadModel

        from rayacc.models.hf import gpt2_config, gpt2_state

        values = gpt2_config(model)
        values.pop("model_type")
        gpt2 = GPT2LMHeadModel(GPT2Config(**values))
        missing, unexpected = gpt2.load_state_dict(gpt2_state(model), strict=False)
        # a tied head is the embedding (not a state of its own)
        if [
            k for k in missing if k != "lm_head.weight" or not values["tie_word_embeddings"]
        ] or unexpected:
            raise CheckpointError(
                f"the gpt model does not map onto GPT-2 (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}). Fix: --format safetensors"
            )
        gpt2.tie_weights()
        # GPT-2's own ids (50256) name nothing in the run's vocabulary: the run's tokenizer's
        _set_special(gpt2, special or {})
        gpt2.save_pretrained(str(folder), safe_serialization=True)
        return "a transformers GPT2LMHeadModel (from_pretrained), the same layers as rayacc's gpt"
    raise DataError(
        f"a {type(model).__name__} has no transformers counterpart (only model.name hf and gpt "
        "export as one). Fix: --format safetensors"
    )


GPT2_BASE = "base"
"""Where a `gpt` run's peft export keeps the GPT-2 its adapter applies to (beside it)."""
_GPT2_LAYERS = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.0": "mlp.c_fc",
                "mlp.2": "mlp.c_proj"}  # fmt: skip
"""A `gpt` block's linear layers under GPT-2's names (`models/hf.py::gpt2_state` maps the
weights)."""


def _gpt2_name(path: str) -> str:
    """A `gpt` module path as GPT-2's (`blocks.0.attn.qkv`: `transformer.h.0.attn.c_attn`)."""
    if path == "head":
        return "lm_head"
    if path.startswith("blocks."):
        _, i, layer = path.split(".", 2)
        return f"transformer.h.{i}.{_GPT2_LAYERS.get(layer, layer)}"
    return path


def _gpt2_adapter(peft_model, folder: Path, special, final: Path | None) -> str:
    """A `gpt` run's adapter as peft applies it to the GPT-2 the gpt is (GPT-2's module names,
    its Conv1D layers' `fan_in_fan_out`), that GPT-2 written beside it (`base/`) and named as
    the adapter's base: `AutoPeftModelForCausalLM.from_pretrained(DIR)` loads the run."""
    import copy

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = copy.deepcopy(peft_model.peft_config["default"])
    adapters = get_peft_model_state_dict(peft_model)
    base = peft_model.unload()  # the base's own layers back in place, unmerged
    _write(base, folder / GPT2_BASE, "hf", special)
    prefix = "base_model.model."
    renamed = {}
    for key, value in adapters.items():
        path, _, rest = key.removeprefix(prefix).partition(".lora_")
        renamed[f"{prefix}{_gpt2_name(path)}.lora_{rest}"] = value.contiguous()
    targets = sorted({k.removeprefix(prefix).split(".lora_")[0] for k in renamed})
    config.target_modules = targets
    config.fan_in_fan_out = True  # GPT-2's Conv1D (peft turns it off for the Linear head)
    config.task_type = "CAUSAL_LM"
    config.base_model_name_or_path = str(((final or folder) / GPT2_BASE).resolve())
    config.save_pretrained(str(folder))
    save_file(renamed, str(folder / "adapter_model.safetensors"))
    return (
        "a peft adapter on the GPT-2 the gpt is, that GPT-2 beside it in base/ "
        "(AutoPeftModelForCausalLM.from_pretrained)"
    )


def _is_lora(model) -> bool:
    from rayacc.models.lora import adapter_root

    return getattr(adapter_root(model), "peft_config", {}).get("default") is not None


def _as_peft(model, folder: str, base_folder: str | None):
    """The run's base (the checkpoint's weights without the adapters: nothing is read outside
    the folder) under a `PeftModel` holding the checkpoint's adapters."""
    import copy

    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    from rayacc.data.common import DataError
    from rayacc.models.lora import adapter_root

    root = adapter_root(model)
    config = getattr(root, "peft_config", {}).get("default")
    if config is None:
        from rayacc.models.gpt import GPT
        from rayacc.models.hf import HFCausalLM

        # the format this kind exports whole: transformers' for gpt and hf, else its own
        whole = "hf" if isinstance(model, GPT | HFCausalLM) else "safetensors"
        raise DataError(
            f"{folder} is not a LoRA run's checkpoint (no model.lora). Fix: --format {whole}"
        )
    adapters = get_peft_model_state_dict(root)
    base = copy.deepcopy(root)
    for name, module in list(base.named_modules()):
        if isinstance(module, LoraLayer):
            parent, _, leaf = name.rpartition(".")
            setattr(base.get_submodule(parent), leaf, module.base_layer)
    del base.peft_config
    config = copy.deepcopy(config)
    # what the adapter names as its base: the folder the caller named (none: built from the seed)
    config.base_model_name_or_path = str(Path(base_folder).resolve()) if base_folder else None
    if hasattr(base, "generation_config"):  # a transformers causal LM: peft's task for it
        config.task_type = "CAUSAL_LM"
        # peft saves the base model's own name: the folder named, not where it was read from
        base.name_or_path = config.base_model_name_or_path or ""
        base.config._name_or_path = base.name_or_path
    peft_model = get_peft_model(base, config)
    loaded = set_peft_model_state_dict(
        peft_model, {f"base_model.model.{k}": v for k, v in adapters.items()}
    )
    if loaded.unexpected_keys:
        raise DataError(
            f"{folder}: adapters with no place in the base: {loaded.unexpected_keys[:3]}"
        )
    return peft_model.eval()


def _untie_adapted(peft_model) -> None:
    """An adapted layer whose weight is tied to another (a head tied to the embedding) gets a
    copy of its own before the merge: merged in place, the delta would change the embedding
    too. The merged model then says its head is its own (`tie_word_embeddings: false`)."""
    import torch
    from peft.tuners.lora import LoraLayer

    names: dict[int, int] = {}
    for _, p in peft_model.named_parameters(remove_duplicate=False):
        names[id(p)] = names.get(id(p), 0) + 1
    untied = False
    for module in peft_model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(module, LoraLayer) and names.get(id(getattr(base, "weight", None)), 0) > 1:
            base.weight = torch.nn.Parameter(base.weight.detach().clone(), requires_grad=False)
            untied = True
    config = getattr(peft_model.get_base_model(), "config", None)
    if untied and config is not None:
        config.tie_word_embeddings = False


def _vocabulary(folder: str):
    """The run's vocabulary a token model's checkpoint carries; None for other models."""
    from rayacc.driver.sample import checkpoint_vocabulary, described_dataset

    tokens = described_dataset(folder).get("format") == "tokens"
    return checkpoint_vocabulary(folder) if tokens else None


def _tokenizer(vocabulary):
    """The run's tokenizer as transformers loads it, with the chat set-up the data was
    rendered with (its template, special tokens; a pad token where it has none: its end of
    text, the field's convention), or None where the data records ids only."""
    tok = vocabulary.hf_tokenizer() if vocabulary is not None else None
    if tok is None:
        return None
    from transformers import PreTrainedTokenizerFast

    from rayacc.data.vocab import EOD_TOKEN

    setup = vocabulary.chat_setup()
    special = {k: setup[k] for k in ("bos_token", "eos_token", "pad_token") if k in setup}
    if "eos_token" not in special and tok.token_to_id(EOD_TOKEN) is not None:
        special["eos_token"] = EOD_TOKEN
    if "pad_token" not in special and "eos_token" in special:
        special["pad_token"] = special["eos_token"]
    template = {"chat_template": setup["chat_template"]} if "chat_template" in setup else {}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, **special, **template)
    out.end_of_turn = setup.get("end_of_turn")
    return out


def _special_ids(tokenizer, vocabulary) -> dict[str, int | None]:
    """The special ids the exported config and generation config name: the tokenizer's (its
    end of text, and a chat template's end of turn, where generation stops); none without a
    tokenizer."""
    if tokenizer is None:
        return {}

    def id_of(token: str | None) -> int | None:
        return tokenizer.convert_tokens_to_ids(token) if token else None

    return {
        "bos": id_of(tokenizer.bos_token),
        "eos": id_of(tokenizer.eos_token),
        "pad": id_of(tokenizer.pad_token),
        "end_of_turn": id_of(getattr(tokenizer, "end_of_turn", None)),
    }


def _set_special(model, special: dict[str, int | None] | None) -> None:
    """The config's and the generation config's special ids: the tokenizer's where one is
    exported (`special`), the model's own otherwise (None: given none); never an id outside
    the vocabulary (transformers warns, and generation never stops)."""
    vocab = model.get_input_embeddings().num_embeddings
    config, generation = model.config, model.generation_config
    for key in ("bos", "eos", "pad"):
        value = special.get(key) if special else getattr(config, f"{key}_token_id", None)
        if special is None and isinstance(value, list):
            value = [v for v in value if 0 <= v < vocab] or None
        elif not isinstance(value, int) or not 0 <= value < vocab:
            value = None
        setattr(config, f"{key}_token_id", value)
        setattr(generation, f"{key}_token_id", value)
    if special:
        # generation stops on the end of text and on a chat template's end of turn
        stops = [i for i in (special.get("eos"), special.get("end_of_turn"))
                 if isinstance(i, int) and 0 <= i < vocab]  # fmt: skip
        stops = list(dict.fromkeys(stops))
        generation.eos_token_id = stops[0] if len(stops) == 1 else stops or None


def _write_tokenizer(vocabulary, tokenizer, folder: Path) -> str:
    """The run's tokenizer beside the weights, so `AutoTokenizer.from_pretrained` encodes as
    the run did (and `apply_chat_template` renders as its data was); what was written, as a
    phrase to add."""
    if vocabulary is None:
        return ""
    if tokenizer is None:
        return "; no tokenizer: the run's data records token ids only, no text"
    tokenizer.save_pretrained(str(folder))
    chat = ", its chat template" if tokenizer.chat_template else ""
    return f", and the run's tokenizer ({vocabulary.describe()}{chat})"
