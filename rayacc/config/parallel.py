"""The run's parallel layout in the config: what every section is (`Section`), the strategies'
own sections (`fsdp`, `deepspeed`) and the rules of the mesh's degrees beyond data
parallelism (`train.tensor_parallel`, `train.pipeline_parallel`), each checked against the
strategy, the worker count and the model."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rayacc.config.errors import ConfigIssue
from rayacc.config.mesh import Mesh

__all__ = [
    "PIPELINE_SCHEDULES",
    "ZBV_SHARDED",
    "Count",
    "DeepSpeedConfig",
    "FSDPConfig",
    "Section",
    "pipeline_rules",
    "tensor_parallel_rules",
]

Count = Annotated[int, Field(ge=1)]
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
"""`train.pipeline_schedule` (engine/parallel/pipeline.py runs them): fill-drain (GPipe), one
forward one backward (1F1B), 1F1B over several stages per rank (Interleaved1F1B), and the
zero-bubble V (ZBVZeroBubble: two stages per rank, the backward split in input and weight)."""
ZBV_SHARDED = (
    "pipeline_schedule zbv with more ranks than pipeline stages: its weight backward runs on "
    "the sharded parameters FSDP's forward does not use, so its stages would get no weight "
    "gradients (torch 2.13). Fix: use interleaved_1f1b, or pipeline_parallel = num_workers"
)


class Section(BaseModel):
    # attribute docstrings become field descriptions, which error messages quote as the fix
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


class FSDPConfig(Section):
    """`train.strategy: fsdp` (docs/design.md, "Memory strategies")."""

    grad_sync: Literal["every_micro_step", "window_end"] = "every_micro_step"
    """How gradients are reduce-scattered across a window: `every_micro_step` after each
    micro-step's backward (gradients stay sharded: the least memory), or `window_end` once per
    window (`set_requires_gradient_sync(False)` on the others: one reduce-scatter per block and
    window, but every rank holds unsharded gradients for the whole model meanwhile)."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (gathered again in backward)."""
    mixed_precision: bool = True
    """bf16 runs: blocks compute in bf16, gradients reduced in float32."""
    replicate: Count | Literal["auto"] = 1
    """Replica groups (HSDP): parameters sharded inside each group of workers / replicate ranks,
    replicated across the groups (sharded gradients all-reduced once per window). 1 = shard over
    every rank; `auto` = one group per node of the worker group's placement (gathers and
    reduce-scatters on a node's fast links), 1 where nodes hold unequal numbers of workers. A
    number must divide the worker count."""
    offload: Literal["none", "cpu"] = "none"
    """`cpu`: the sharded parameters, their gradients and the optimizer state live in host
    memory and the optimizer steps there (FSDP2's `CPUOffloadPolicy`): device memory for what
    does not fit sharded, paid for with host↔device copies every micro-step."""


class DeepSpeedConfig(Section):
    """`train.strategy: deepspeed`: DeepSpeed ZeRO (`pip install rayacc[deepspeed]`;
    docs/design.md, "Parallel strategies"). rayacc owns the batch, the optimizer, the precision
    and clipping: it writes those keys of DeepSpeed's config from the job."""

    stage: Literal[1, 2, 3] = 2
    """ZeRO stage: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """Keep the optimizer state (and its step) in host memory (ZeRO-Offload)."""
    offload_params: Literal["none", "cpu"] = "none"
    """Keep the parameters in host memory between uses (ZeRO-Infinity; stage 3 only)."""
    config: str | None = None
    """A `deepspeed_config.json` of your own, merged under rayacc's keys; one that sets the
    batch, precision, optimizer or clipping otherwise than the job is an error naming both."""


# ----------------------------------------------------------------------------- the degrees' rules
def _degree_rules(kind: str, train: Any, scaling: Any) -> list[tuple[str, str]]:
    """(problem, fix) of `train.{kind}_parallel` against a fixed worker count (a multiple of
    it)."""
    n, out = getattr(train, f"{kind}_parallel"), []
    # the strategy and an elastic range are pairs of features (config/features.py)
    if scaling is not None and not scaling.elastic and scaling.min_workers % n:
        out.append((f"does not divide scaling.num_workers={scaling.min_workers}",
                     f"set scaling.num_workers to a multiple of {n}"))  # fmt: skip
    return out


def tensor_parallel_rules(train: Any, sections: dict[str, Any], scaling: Any) -> list[ConfigIssue]:
    """Tensor parallelism: under a strategy that composes with it (the registry says which), a
    fixed worker count it divides, whole heads per rank, a model that declares a plan (an `hf`
    architecture's is checked before launch)."""
    tp = train.tensor_parallel
    if tp == 1:
        return []
    field, issues = "train.tensor_parallel", []

    def refuse(problem: str, fix: str) -> None:
        issues.append(ConfigIssue(field, problem, tp, fix))

    for problem, fix in _degree_rules("tensor", train, scaling):
        refuse(problem, fix)
    model = sections.get("model")
    if scaling is not None and scaling.placement_strategy in ("SPREAD", "STRICT_SPREAD"):
        # its all-reduces run every layer: across nodes they would cross the slow links
        refuse(f"needs each tensor-parallel group on one node, which "
               f"scaling.placement_strategy={scaling.placement_strategy} spreads over nodes",
               "set scaling.placement_strategy=PACK, or train.tensor_parallel=1")  # fmt: skip
    if model is not None and model.name == "gpt" and model.n_head % tp:
        refuse(f"does not divide model.n_head={model.n_head} (each rank takes whole heads)",
               "choose a train.tensor_parallel that divides model.n_head")  # fmt: skip
    if model is not None and model.name == "mlp":
        refuse("the mlp model declares no tensor-parallel plan",
               "use model.name=gpt or hf, or train.tensor_parallel=1")  # fmt: skip
    return issues


def pipeline_rules(train: Any, sections: dict[str, Any], scaling: Any) -> list[ConfigIssue]:
    """Pipeline parallelism: under a strategy that composes with it (the registry says which;
    its own rules say with which of its settings), with tensor parallelism inside its stages,
    a fixed worker count it divides, a model that declares its split with enough units for
    the stages, a loss the last stage computes whole and a micro-batch that does not change."""
    pp, issues = train.pipeline_parallel, []
    if pp == 1:
        fields = type(train).model_fields
        chosen = [k for k in ("pipeline_schedule", "pipeline_stages_per_rank")
                  if getattr(train, k) != fields[k].default]  # fmt: skip
        return [
            ConfigIssue(
                f"train.{k}",
                "applies to a pipeline only",
                getattr(train, k),
                "set train.pipeline_parallel > 1, or remove it",
            )
            for k in chosen
        ]

    def refuse(problem: str, fix: str, field: str = "train.pipeline_parallel") -> None:
        issues.append(ConfigIssue(field, problem, getattr(train, field.split(".")[-1], pp), fix))

    for problem, fix in _degree_rules("pipeline", train, scaling):
        refuse(problem, fix)
    both = pp * train.tensor_parallel
    if scaling is not None and not scaling.elastic and both > pp and scaling.min_workers % both:
        refuse(f"× train.tensor_parallel={train.tensor_parallel} = {both} does not divide "
               f"scaling.num_workers={scaling.min_workers}",
               f"set scaling.num_workers to a multiple of {both}")  # fmt: skip
    if (
        scaling is not None
        and not scaling.elastic
        and train.pipeline_schedule == "zbv"
        and (scaling.min_workers > pp)
    ):
        refuse(ZBV_SHARDED.split(". Fix: ")[0], ZBV_SHARDED.split(". Fix: ")[1],
               "train.pipeline_schedule")  # fmt: skip
    stages = pp * Mesh.of_sections(train).stages_per_rank
    model = sections.get("model")
    if model is not None and model.name not in ("gpt", "hf"):
        refuse(f"model.name={model.name} declares no split into pipeline stages",
               "use model.name=gpt or hf, or train.pipeline_parallel=1")  # fmt: skip
    elif model is not None and model.name == "gpt" and model.n_layer + 2 < stages:
        refuse(f"{stages} stages take one unit each of model.n_layer={model.n_layer} blocks, "
               "the embeddings and the head", "use fewer stages or more layers")  # fmt: skip
    chunk = type(train).model_fields["loss_chunk_tokens"].default
    if train.loss_chunk_tokens not in (None, chunk):
        refuse("the last stage computes its micro-batch's logits whole",
               "remove train.loss_chunk_tokens", "train.loss_chunk_tokens")  # fmt: skip
    return issues
