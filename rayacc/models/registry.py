"""build_model(cfg): the same initial weights on every worker, from cfg.seed."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable

import torch
from torch import nn

from rayacc.config import TrainConfig
from rayacc.config.mesh import Mesh
from rayacc.config.schema import ModelConfig
from rayacc.data.sources import DatasetInfo, describe_dataset
from rayacc.engine import (
    classification_item_losses,
    count_rows,
    count_target_tokens,
    token_item_losses,
)
from rayacc.engine.chunked_loss import chunked_cross_entropy_sum
from rayacc.engine.losses import counted_with_losses, model_inputs
from rayacc.engine.parallel import Strategy
from rayacc.engine.parallel import unwrap as unwrap_model
from rayacc.models.errors import ModelError
from rayacc.models.init import init_parameters, seeds_parameters

__all__ = [
    "ModelError",
    "build_model",
    "build_on_meta",
    "check_pipeline_split",
    "check_tensor_plan",
    "loss_functions",
    "resolve_factory",
    "supports_chunked_loss",
    "unwrap_model",
]


_FACTORY_FIX = (
    "Fix: model.factory is `package.module:function`, importable on every node (an installed "
    "package or the job's working_dir), and the function is called as "
    "`function(dataset=DatasetInfo, **model.kwargs)` and returns an nn.Module"
)


def resolve_factory(spec: str) -> Callable[..., nn.Module]:
    return resolve_callable("model.factory", spec, _FACTORY_FIX)


def resolve_callable(field: str, spec: str, fix: str) -> Callable:
    """The function `package.module:function` a config field names (ModelError naming the
    field, what is wrong and `fix`)."""
    module_name, colon, fn_name = spec.partition(":")
    if not colon or not module_name or not fn_name:
        raise ModelError(f"{field}={spec!r} is not `package.module:function`. {fix}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an error inside the module is the user's, as a missing one is
        raise ModelError(
            f"{field}={spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}). {fix}"
        ) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ModelError(f"{field}={spec!r}: {module_name} has no callable {fn_name!r}. {fix}")
    return fn


def _call_factory(spec: str, info: DatasetInfo, kwargs: dict) -> nn.Module:
    fn = resolve_factory(spec)
    try:
        model = fn(dataset=info, **kwargs)
    except Exception as exc:
        raise ModelError(
            f"model.factory={spec!r} failed when called with dataset and model.kwargs="
            f"{kwargs!r}: {type(exc).__name__}: {exc}. {_FACTORY_FIX}"
        ) from exc
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model.factory={spec!r} returned {type(model).__name__}, not an nn.Module. "
            f"{_FACTORY_FIX}"
        )
    return model


def build_model(cfg: TrainConfig, info: DatasetInfo | None = None) -> nn.Module:
    """The model of `cfg`, initialised deterministically from `cfg.seed` (global RNG untouched)."""
    if info is None:
        info = describe_dataset(cfg.data.source, cfg.data.cache_dir, cfg.data.seq_len)
    m = cfg.model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = _build_base(cfg.model, info, cfg.seed)
        if m.lora is not None:
            from rayacc.models.lora import apply_lora

            model = apply_lora(model, m.lora)
            if seeds_parameters(model):
                init_parameters(model, cfg.seed)
        return model


def _build_base(m: ModelConfig, info: DatasetInfo, seed: int) -> nn.Module:
    """The model `m` describes, without adapters (the caller seeds the global RNG)."""
    if m.name == "factory":
        model = _call_factory(m.factory or "", info, m.kwargs)
        if seeds_parameters(model):
            init_parameters(model, seed)
        return model
    if m.name == "mlp":
        if info.format != "classification":
            raise ModelError(
                f"model.name=mlp needs classification data (`features`, `label`); "
                f"{info.path} holds {info.format}. Fix: use model.name=gpt"
            )
        from rayacc.models.mlp import MLP

        return MLP(info.num_features, info.num_classes, m.hidden_sizes, m.dropout)
    if info.format != "tokens":
        raise ModelError(
            f"model.name={m.name} needs token data (`tokens`); {info.path} holds "
            f"{info.format}. Fix: use model.name=mlp"
        )
    if m.name == "hf":
        from rayacc.models.hf import build_hf, resolve_hf_config

        config = resolve_hf_config(m.hf.config, m.hf.weights)
        return build_hf(config, m.hf.weights, info.vocab_size, info.max_tokens)
    if info.max_tokens - 1 > m.block_size:
        raise ModelError(
            f"model.block_size={m.block_size} is shorter than the longest sequence of "
            f"{info.path} ({info.max_tokens - 1} input tokens). Fix: raise model.block_size"
        )
    from rayacc.models.gpt import GPT

    return GPT(info.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.dropout, seed)


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no
    initialisation) and their buffers for real: a buffer's value comes from the module's own
    code (a causal mask, rotary tables) and no rule of parameter initialisation can recreate it.
    Each parameter exists on the CPU for a moment, uninitialised, as it is registered."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        param = module._parameters.get(name)
        if param is not None and not param.is_meta:
            # tied parameters arrive on meta already and keep their identity
            module._parameters[name] = type(param)(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_on_meta(cfg: TrainConfig, info: DatasetInfo) -> nn.Module:
    """The model with its parameters on the meta device (shapes only, no memory) and its buffers
    real: for counting on the driver, and for a sharded run to materialise only each rank's
    shards. A factory that cannot build so is built for real."""
    try:
        with parameters_on_meta():
            return build_model(cfg, info)
    except (NotImplementedError, RuntimeError, ModelError):
        # a real build says what is wrong, if anything is
        return build_model(cfg, info)


def supports_chunked_loss(model: nn.Module, inside_forward: bool) -> bool:
    """A token model with an `nn.Linear` `head` whose forward can return the hidden states the
    head projects (`return_hidden`), or, with `inside_forward`, apply a loss to them and the
    head itself (`head_loss`)."""
    inner = unwrap_model(model)
    takes = inspect.signature(inner.forward).parameters
    needed = "head_loss" if inside_forward else "return_hidden"
    return isinstance(getattr(inner, "head", None), nn.Linear) and needed in takes


def loss_functions(
    info: DatasetInfo,
    chunk: int | None = None,
    strategy: Strategy | None = None,
    objective: str | None = None,
    counts_first: bool = False,
):
    """(per-item loss, item counter) for a dataset format, or the user's `objective`
    (`train.loss`: counting its own items, or with `counts_first` checked against rayacc's
    count, made before the forward). Token models that support it (see
    `supports_chunked_loss`) get the chunked cross-entropy when `chunk` is set; where it runs
    is the strategy's word (`Contract.gathers_in_forward`: a sharded head is whole only inside
    the forward that gathered it)."""
    if objective is not None:
        from rayacc.models.objective import OBJECTIVE_FIX, Objective, check_weighted

        fn = resolve_callable("train.loss", objective, OBJECTIVE_FIX)
        classification = info.format == "classification"
        key = "features" if classification else "input"
        if not counts_first:
            return Objective(objective, fn, key), counted_with_losses
        check_weighted(objective, fn, "", "the strategy or the precision counts first")
        counter = count_rows if classification else count_target_tokens
        return Objective(objective, fn, key, ahead=counter), counter
    if info.format == "classification":
        return classification_item_losses, count_rows
    inside = strategy is not None and strategy.contract.gathers_in_forward
    # a pipeline's last stage hands its output on: the loss takes the logits as they are
    plain = strategy is None or strategy.contract.pipelined
    if chunk is None or plain or not supports_chunked_loss(strategy.model, inside):
        return token_item_losses, count_target_tokens

    def head_loss_of(batch):
        def head_loss(hidden: torch.Tensor, head: nn.Linear) -> torch.Tensor:
            return chunked_cross_entropy_sum(
                hidden, head.weight, batch["target"], bias=head.bias, chunk=chunk
            )

        return head_loss

    def inside_forward(m: nn.Module, batch) -> torch.Tensor:
        return m(batch["input"], head_loss=head_loss_of(batch), **model_inputs(batch))

    def after_forward(m: nn.Module, batch) -> torch.Tensor:
        # through the wrapper's forward (DDP prepares its gradient sync there); the head's
        # weight is then used directly, which DDP's per-parameter hooks see all the same (a
        # compiled forward returns the hidden states and the loss stays eager)
        hidden = m(batch["input"], return_hidden=True, **model_inputs(batch))
        return head_loss_of(batch)(hidden, unwrap_model(m).head)

    return (inside_forward if inside else after_forward), count_target_tokens


def check_pipeline_split(model, mesh: Mesh) -> None:
    """The model declares its split into pipeline stages (an `hf` architecture's checked), with
    a unit for each of the mesh's stages (ModelError naming what does not)."""
    units = getattr(model, "pipeline_units", None)
    if units is None:
        raise ModelError(f"{mesh.setting('pipeline')}: {type(model).__name__} declares no "
                         "split into pipeline stages (`pipeline_units()`, "
                         "`keep_pipeline_units(units)`)")  # fmt: skip
    try:
        count = len(units())
    except ModelError as e:
        raise ModelError(f"{mesh.setting('pipeline')}: {e}") from None
    stages = mesh.pipeline * mesh.stages_per_rank
    if count < stages:
        raise ModelError(
            f"{mesh.setting('pipeline')}: {stages} stages take a unit each of the model's "
            f"{count} (embeddings, layers, head). Fix: use fewer stages or more layers"
        )


def check_tensor_plan(model, mesh: Mesh) -> None:
    """The model declares a tensor-parallel plan, and its heads (an `hf` config's, the GPT's
    attention's) divide over the mesh's tensor ranks (ModelError naming what does not)."""
    from rayacc.engine.parallel.tensor import tp_plan

    tp = mesh.tensor
    try:
        tp_plan(model)
    except ValueError as e:
        raise ModelError(f"{mesh.setting('tensor')}: {e}") from None
    config = getattr(getattr(model, "hf", None), "config", None)
    heads = {
        key: getattr(config, key, None) for key in ("num_attention_heads", "num_key_value_heads")
    }
    heads["n_head"] = next((m.n_head for m in model.modules() if hasattr(m, "n_head")), None)
    for key, count in heads.items():
        if isinstance(count, int) and count % tp:
            raise ModelError(
                f"{mesh.setting('tensor')} does not divide the model's {key}={count} (each "
                f"rank takes whole heads). Fix: choose a {Mesh.key('tensor')} that divides it"
            )
