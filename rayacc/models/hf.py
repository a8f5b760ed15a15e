"""Hugging Face causal LMs in and out (`pip install 'rayacc[hf]'`; `transformers` is imported
only here, and only when a run or a command uses it).

More: docs/design.md, "Notes from the code" (models/hf.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayacc.config.mesh import Mesh
from rayacc.models.errors import ModelError

__all__ = [
    "HFCausalLM",
    "build_hf",
    "gpt2_config",
    "gpt2_state",
    "resolve_hf_config",
]


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ModelError(
            "model.name=hf needs Hugging Face transformers. Fix: pip install 'rayacc[hf]'"
        ) from None
    return transformers


class HFCausalLM(nn.Module):
    """A `transformers` causal LM as rayacc trains it: token ids in, logits out (the loss is
    rayacc's over them). Right padding needs no attention mask: a causal model's real positions
    never attend to the padding that follows them, and padded targets are ignored."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.hf = model
        config = model.config
        self.block_size = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )

    @property
    def _staged(self) -> bool:
        """Cut to a pipeline stage (`keep_pipeline_units`)."""
        base = getattr(self.hf, "base_model", None)
        return getattr(base, "embed_tokens", 0) is None or getattr(self.hf, "lm_head", 0) is None

    def forward(self, idx: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; `documents` (packed rows: each position's example): each example attends to
        itself only, its positions from 0 (a 4-D mask of the kind the attention implementation
        takes; flash attention reads the examples from the positions)."""
        if documents is None and self._staged:
            return self._stage_forward(idx)
        if documents is None:
            return self.hf(input_ids=idx, use_cache=False).logits
        from rayacc.models.gpt import document_mask, document_positions

        kind = getattr(self.hf.config, "_attn_implementation", "sdpa") or "sdpa"
        mask = None if "flash" in kind else document_mask(documents)
        if mask is not None and kind == "eager":  # eager adds its mask to the scores
            dtype = self.hf.get_input_embeddings().weight.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=idx.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        out = self.hf(
            input_ids=idx,
            position_ids=document_positions(documents),
            attention_mask=mask,
            use_cache=False,
        )
        return out.logits

    def tp_plan(self) -> dict:
        """The tensor-parallel plan `transformers` declares for the architecture
        (`base_model_tp_plan`: `colwise` / `rowwise` per linear of its layers); a ModelError
        naming the architecture where it declares none, or a style rayacc does not apply."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        config = self.hf.config
        plan = getattr(config, "base_model_tp_plan", None)
        if not plan:
            raise ModelError(
                f"model.hf: the {config.model_type!r} architecture declares no tensor-parallel "
                "plan (`base_model_tp_plan` in transformers): it cannot be split over a "
                "tensor-parallel group. Fix: choose an architecture that declares one (llama, "
                "mistral, qwen2, …)"
            )
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        other = sorted({v for v in plan.values() if v not in styles})
        if other:
            raise ModelError(
                f"model.hf: the {config.model_type!r} plan uses the style(s) {', '.join(other)}, "
                f"which rayacc does not apply (it applies {', '.join(styles)})"
            )
        base = f"hf.{self.hf.base_model_prefix}"
        return {f"{base}.{path}": styles[style]() for path, style in plan.items()}

    PIPELINED = ("llama", "mistral", "qwen2", "qwen3")
    """Architectures whose base model's forward takes a stage's hidden states as its
    `inputs_embeds` unchanged (embeddings, decoder layers, final norm, head)."""

    def _pipeline_parts(self):
        kind = self.hf.config.model_type
        if kind not in self.PIPELINED:
            raise ModelError(
                f"model.hf: the {kind!r} architecture is not split into pipeline stages by "
                f"rayacc (it splits {', '.join(self.PIPELINED)}). Fix: choose one of those, or "
                f"{Mesh.key('pipeline')}=1"
            )
        return self.hf.base_model

    def pipeline_units(self) -> list[int]:
        """The parameters of each unit a pipeline splits: the embeddings, each decoder layer,
        the final norm with the head (a tied head counted with both)."""
        base = self._pipeline_parts()
        count = lambda *ms: sum(p.numel() for m in ms for p in m.parameters())  # noqa: E731
        return [count(base.embed_tokens), *map(count, base.layers),
                count(base.norm, self.hf.lm_head)]  # fmt: skip

    def pipeline_tied(self) -> dict[str, str]:
        """A tied head's weight → the embedding it shares its value with."""
        if not getattr(self.hf.config, "tie_word_embeddings", False):
            return {}
        prefix = f"hf.{self.hf.base_model_prefix}"
        return {"hf.lm_head.weight": f"{prefix}.embed_tokens.weight"}

    def keep_pipeline_units(self, units) -> HFCausalLM:
        """This model cut down, in place, to `units` (`pipeline_units`' indices), the whole
        model's names kept: the decoder layers a stage holds stay under their indices (the
        base model's own forward runs them in order), a stage without the embeddings takes
        hidden states (`inputs_embeds`), one without the head gives them (its final norm an
        identity). A tied head on a last stage without the embedding gets a weight of its
        own (the pipeline sums the two copies' gradients)."""
        base = self._pipeline_parts()
        last = self.hf.config.num_hidden_layers + 1
        if 0 not in units:
            embed = base.embed_tokens  # None where the part this stage is cut from has none
            if last in units and embed is not None and self.hf.lm_head.weight is embed.weight:
                # its own copy, frozen where the embedding is (a LoRA base)
                weight = self.hf.lm_head.weight
                self.hf.lm_head.weight = nn.Parameter(weight.detach().clone(), weight.requires_grad)
            base.embed_tokens = None
        if last not in units:
            base.norm, self.hf.lm_head = nn.Identity(), None
        held = dict(base.layers.named_children())
        kept = nn.ModuleList()
        kept._modules.update((str(i - 1), held[str(i - 1)]) for i in units if 0 < i < last)
        base.layers = kept  # iterated in order under their own names
        return self

    def pipeline_view(self) -> HFCausalLM:
        """A view of this model that a cut leaves this one as it was (a rank's stages cut
        from its part): its own wrapper, causal LM and base model, sharing their children."""
        from rayacc.engine.parallel.pipeline import shallow_copy

        view = shallow_copy(self)
        view.hf = shallow_copy(self.hf)
        prefix = self.hf.base_model_prefix
        setattr(view.hf, prefix, shallow_copy(getattr(self.hf, prefix)))
        return view

    def _stage_forward(self, idx: torch.Tensor) -> torch.Tensor:
        base = self.hf.base_model
        given = {"input_ids": idx} if base.embed_tokens is not None else {"inputs_embeds": idx}
        hidden = base(**given, use_cache=False).last_hidden_state
        return hidden if self.hf.lm_head is None else self.hf.lm_head(hidden)

    def fsdp_blocks(self) -> list[nn.Module]:
        """The decoder layers: the classes the model names as never to be split."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        # by class lineage: once sharded, FSDP2 makes each a subclass of its own
        return [m for m in self.hf.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def resolve_hf_config(config: str | dict[str, Any] | None, weights: str | None) -> dict[str, Any]:
    """The model's config as a mapping (`model_type` included), read from the file or folder
    named (`model.hf.config`, else `model.hf.weights`' config.json), on this machine."""
    t = _transformers()
    if isinstance(config, dict):
        return dict(config)
    where, field = (
        (config, "model.hf.config") if config is not None else (weights, "model.hf.weights")
    )
    path = Path(str(where)).expanduser()
    folder = path.parent if path.is_file() else path
    file = path if path.is_file() else path / "config.json"
    if not file.is_file():
        raise ModelError(
            f"{field}={where!r}: no config.json there. Fix: give a transformers config.json, a "
            "folder holding one (save_pretrained's), or a mapping with model_type"
        )
    try:
        loaded = t.AutoConfig.from_pretrained(
            str(folder if file.name == "config.json" else file),
            local_files_only=True,
            trust_remote_code=False,
        )
    except Exception as exc:  # transformers' own errors name what is wrong with the file
        raise ModelError(
            f"{field}={where!r}: transformers cannot read it ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:300]}). Fix: give the config.json of a model type "
            "transformers ships"
        ) from None
    return loaded.to_dict()


def _config(mapping: dict[str, Any]):
    t = _transformers()
    values = dict(mapping)
    model_type = values.pop("model_type", None)
    # a config that names code to run (its own classes) is not built: built-in types only
    values.pop("auto_map", None)
    try:
        return t.AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as exc:
        raise ModelError(
            f"model.hf.config: model_type={model_type!r} is not a type transformers ships "
            f"({str(exc).splitlines()[0][:200]}). Fix: use one of transformers' model types "
            "(llama, gpt2, mistral, qwen2, ...)"
        ) from None


def build_hf(
    config: dict[str, Any], weights: str | None, vocab_size: int, max_tokens: int
) -> HFCausalLM:
    """The causal LM of `config` (a resolved mapping), from `weights` (a local folder) or
    initialised from the global RNG (the caller seeds it), in float32."""
    t = _transformers()
    cfg = _config(config)
    if getattr(cfg, "vocab_size", vocab_size) < vocab_size:
        raise ModelError(
            f"model.hf.config: vocab_size={cfg.vocab_size} is smaller than the data's token ids "
            f"(up to {vocab_size - 1}). Fix: a config with vocab_size >= {vocab_size}, or data "
            "tokenized with the model's tokenizer"
        )
    positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if positions is not None and max_tokens - 1 > positions:
        raise ModelError(
            f"model.hf.config: max_position_embeddings={positions} is shorter than the data's "
            f"longest sequence ({max_tokens - 1} input tokens). Fix: data.seq_len <= {positions}"
        )
    if weights is None:
        model = t.AutoModelForCausalLM.from_config(
            cfg, trust_remote_code=False, dtype=torch.float32
        )
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rayacc-weights-") as view:
            shown = weights_view(weights, Path(view))
            if not (shown / GENERATION_CONFIG).exists():
                # transformers 5 fails on a folder without one (a None path)
                t.GenerationConfig.from_model_config(cfg).to_json_file(shown / GENERATION_CONFIG)
            try:
                model = t.AutoModelForCausalLM.from_pretrained(
                    str(shown),
                    config=cfg,
                    local_files_only=True,
                    trust_remote_code=False,
                    use_safetensors=True,
                    dtype=torch.float32,
                )
            except Exception as exc:  # transformers' and safetensors' own errors, made ours
                raise ModelError(
                    f"model.hf.weights={weights!r}: transformers cannot load the weights there "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                    "). Fix: give the folder save_pretrained (or `rayacc export --format hf`) "
                    "wrote for this model.hf.config"
                ) from None
    model.train()
    return HFCausalLM(model)


SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"


def weights_view(weights: str, into: Path) -> Path:
    """`into`, holding what transformers is to read of the folder `model.hf.weights` names —
    its safetensors weights (one file, or the index and every shard it names) and nothing
    else, each a regular file whose header is safetensors' — as links to the checked files.
    A pickle (`pytorch_model.bin`, or one named `.safetensors`) is never handed on. ModelError
    naming the field and the file otherwise."""
    import json

    field = f"model.hf.weights={weights!r}"
    folder = Path(weights).expanduser()
    if not folder.is_dir():
        raise ModelError(
            f"{field} is not a folder. Fix: give the folder save_pretrained wrote (config.json "
            "and model.safetensors), readable on every node"
        )
    if (folder / SAFETENSORS).exists():
        names = [SAFETENSORS]
    elif (folder / SAFETENSORS_INDEX).exists():
        index = _regular(folder / SAFETENSORS_INDEX, field)
        try:
            shards = json.loads(index.read_text())["weight_map"].values()
            names = [SAFETENSORS_INDEX, *sorted({str(n) for n in shards})]
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise ModelError(
                f"{field}: {folder / SAFETENSORS_INDEX} is not a safetensors index (JSON with a "
                "weight_map). Fix: write the weights again with save_pretrained"
            ) from None
    else:
        pickled = [p.name for p in folder.glob("*.bin")]
        raise ModelError(
            f"{field}: no {SAFETENSORS} (or {SAFETENSORS_INDEX}) there"
            + (
                f"; {', '.join(pickled[:3])} is a pickle, which is not read (it could run code)"
                if pickled
                else ""
            )
            + ". Fix: save the weights as safetensors (save_pretrained's default; "
            "`model.save_pretrained(DIR, safe_serialization=True)`)"
        )
    # the configs beside the weights, as JSON (transformers reads the generation config there)
    names += [n for n in ("config.json", GENERATION_CONFIG) if (folder / n).exists()]
    for name in names:
        if "/" in name or name in ("", ".", ".."):
            raise ModelError(f"{field}: the index names {name!r}, outside the folder")
        source = _regular(folder / name, field)
        if name.endswith(".safetensors"):
            _safetensors_header(source, field)
        (into / name).symlink_to(source)
    return into


def _regular(path: Path, field: str) -> Path:
    """The regular file `path` is (an HF cache's link resolved), or ModelError."""
    import stat

    resolved = path.resolve()
    try:
        mode = resolved.stat().st_mode
    except OSError:
        raise ModelError(f"{field}: {path} is not there. Fix: write the weights again") from None
    if not stat.S_ISREG(mode):
        raise ModelError(f"{field}: {path} is not a regular file. Fix: give the weights' files")
    return resolved


def _safetensors_header(path: Path, field: str) -> None:
    """Refuses a file that does not open as safetensors does: an 8-byte length, then that
    many bytes of a JSON object (what `safe_open` reads first)."""
    import json

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        ok = 2 <= length <= min(size - 8, 100 << 20)
        if ok:
            try:
                ok = isinstance(json.loads(f.read(length)), dict)
            except (ValueError, UnicodeDecodeError):
                ok = False
    if not ok:
        pickled = "; it reads as a pickle, which is not loaded" if head[:1] == b"\x80" else ""
        raise ModelError(
            f"{field}: {path} is not a safetensors file (its header is not one{pickled}). "
            "Fix: save the weights as safetensors with save_pretrained"
        )


# ----------------------------------------------------------------------------- rayacc's gpt out
def gpt2_config(model: nn.Module) -> dict[str, Any]:
    """The GPT-2 config of rayacc's `gpt` model: the same layers (GELU exact, LayerNorm eps
    1e-5, learned positions, its head tied unless adapters merged into it made it its own), so
    `GPT2LMHeadModel` computes the same logits."""
    attn = model.blocks[0].attn
    n_embd = attn.qkv.in_features
    return {
        "model_type": "gpt2",
        "vocab_size": model.tok.num_embeddings,
        "n_positions": model.pos.num_embeddings,
        "n_embd": n_embd,
        "n_layer": len(model.blocks),
        "n_head": attn.n_head,
        "n_inner": model.blocks[0].mlp[0].out_features,
        "activation_function": "gelu",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": model.ln_f.eps,
        "tie_word_embeddings": model.head.weight is model.tok.weight,
        "architectures": ["GPT2LMHeadModel"],
    }


def gpt2_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """rayacc's `gpt` weights under GPT-2's names (its Conv1D layers hold the transposes)."""
    state = {"transformer.wte.weight": model.tok.weight, "transformer.wpe.weight": model.pos.weight}
    for i, block in enumerate(model.blocks):
        h = f"transformer.h.{i}."
        state |= {
            h + "ln_1.weight": block.ln1.weight,
            h + "ln_1.bias": block.ln1.bias,
            h + "attn.c_attn.weight": block.attn.qkv.weight.t(),
            h + "attn.c_attn.bias": block.attn.qkv.bias,
            h + "attn.c_proj.weight": block.attn.proj.weight.t(),
            h + "attn.c_proj.bias": block.attn.proj.bias,
            h + "ln_2.weight": block.ln2.weight,
            h + "ln_2.bias": block.ln2.bias,
            h + "mlp.c_fc.weight": block.mlp[0].weight.t(),
            h + "mlp.c_fc.bias": block.mlp[0].bias,
            h + "mlp.c_proj.weight": block.mlp[2].weight.t(),
            h + "mlp.c_proj.bias": block.mlp[2].bias,
        }
    state |= {
        "transformer.ln_f.weight": model.ln_f.weight,
        "transformer.ln_f.bias": model.ln_f.bias,
    }
    if model.head.weight is not model.tok.weight:
        state["lm_head.weight"] = model.head.weight
    return {k: v.detach().contiguous().clone() for k, v in state.items()}
