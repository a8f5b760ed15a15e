"""The analytic prior: memory per rank and step time of a candidate, from a measured profile.

More: docs/design.md, "Notes from the code" (planner/prior.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rayacc.engine.parallel import strategy_class
from rayacc.engine.parallel.base import CostShape
from rayacc.planner.candidates import Candidate, nodes_spanned
from rayacc.planner.profile import Profile, checkpointing_every

__all__ = [
    "HOST_LINK_BYTES_PER_S",
    "PipelinePlan",
    "Placement",
    "Prediction",
    "TensorPlan",
    "predict",
]


@dataclass(frozen=True)
class Prediction:
    memory_bytes: float
    step_s: float
    compute_s: float
    comm_s: float
    fits: bool
    why_not: str | None = None


def _mib(b: float) -> str:
    mib = b / 2**20
    return f"{mib:,.2f}" if mib < 10 else f"{mib:,.0f}"


def _ring(n: int) -> float:
    return (n - 1) / n


def _scaled(per_byte: float, profile: Profile, n: int) -> float:
    """A collective's time per byte at n ranks from the profile's ranks (a ring moves
    (n-1)/n of the data over each link)."""
    if n == 1 or profile.world == 1:
        return 0.0
    return per_byte * _ring(n) / _ring(profile.world)


HOST_LINK_BYTES_PER_S = 16e9
"""Host↔device copies of an offloaded model (PCIe 4.0 ×16 as measured in practice)."""


@dataclass(frozen=True)
class Placement:
    """How the candidates' workers sit on nodes (`scaling.workers_per_node`, or the joined
    cluster's nodes) and the links between the nodes (`scaling.inter_node_gbps`)."""

    workers_per_node: int | None = None
    """None: every worker on one node."""
    inter_node_gbps: float = 25.0

    def nodes(self, workers: int) -> int:
        return nodes_spanned(workers, self.workers_per_node)

    def per_byte(self, measured: float, profile: Profile, ranks: int, crosses: bool) -> float:
        """A ring collective's time per byte over `ranks`: the profile's rate scaled to them,
        and no faster than the link between nodes when the ring crosses one."""
        t = _scaled(measured, profile, ranks)
        if crosses and ranks > 1:
            t = max(t, _ring(ranks) * 8 / (self.inter_node_gbps * 1e9))
        return t


@dataclass(frozen=True)
class TensorPlan:
    """What the model's tensor-parallel plan splits, for the prior of a candidate that uses it
    (`planner/search.py::tensor_plan` reads it from the model built on the meta device)."""

    split: float
    """The share of the parameters in the plan's layers (of the FLOPs too: a linear's FLOPs
    go with its weights), each rank of a group holding 1 / T of them."""
    allreduces: int
    """All-reduces over the group per micro-step: one per layer of the plan (a column-split
    layer's input gradient in backward, a row-split layer's output in forward)."""
    bytes_per_sample: float
    """Bytes those all-reduces carry per sample, all of them together."""

    def keep(self, t: int) -> float:
        """The share of the model a rank of a group of `t` holds (and computes)."""
        return 1 - self.split + self.split / t


@dataclass(frozen=True)
class PipelinePlan:
    """What cutting the model into stages costs a candidate (`planner/search.py::
    pipeline_plan` reads it from the model built on the meta device)."""

    shares: dict[int, float]
    """Stages → the share of the parameters the fullest rank holds (of its compute and
    activations too: a layer's FLOPs and activations go with its weights)."""
    bytes_per_sample: float
    """Bytes a stage sends the next per sample (the hidden states; their gradient comes back
    the same size)."""


def predict(
    c: Candidate,
    profile: Profile,
    *,
    reshard_after_forward: bool = True,
    bf16_gathers: bool = False,
    placement: Placement = Placement(),
    tensor_plan: TensorPlan | None = None,
    pipeline_plan: PipelinePlan | None = None,
) -> Prediction:
    """The prior of `c` (the profile was measured at the most workers any candidate has, on
    the whole model). A tensor-parallel candidate (`tensor_plan` says what splits): each rank
    holds, computes and keeps the activations of its share of the model (`TensorPlan.keep`:
    the attention scores and the layers left whole are counted as split, an optimistic
    bound), FSDP shards that share over the data-parallel ranks, and the group's all-reduces
    run at the profile's rate on one node's links. A pipeline's candidate (`pipeline_plan`):
    each rank holds and computes its stages' share, its first stage keeps the activations of
    the micro-batches its schedule holds in flight, the window stretches by the schedule's
    idle share, and each micro-batch's hidden states go to the next stage and their gradient
    back (a send costs what an all-reduce of its bytes over two ranks does: each moves them
    once)."""
    key = str(c.checkpointing)
    wing = strategy_class(c.strategy)
    tp = c.tensor_parallel
    if tp > 1 and tensor_plan is None:
        raise ValueError(f"{c.label}: a tensor-parallel candidate needs the model's TensorPlan")
    mesh, pp = c.mesh, c.pipeline_parallel
    if pp > 1 and (pipeline_plan is None or pp not in pipeline_plan.shares):
        raise ValueError(f"{c.label}: a pipeline candidate needs the model's PipelinePlan")
    stage = pipeline_plan.shares[pp] if pp > 1 else 1.0
    keep = (tensor_plan.keep(tp) if tp > 1 else 1.0) * stage
    P, n, m, a = profile.param_bytes * keep, c.workers, c.micro_batch_size, c.grad_accum_steps
    crosses = placement.nodes(n) > 1
    failed = profile.failed.get(key)
    if key not in profile.compute_s:
        inf = float("inf")
        return Prediction(inf, inf, 0.0, 0.0, False, "out of memory in the profile")
    every = checkpointing_every(c.checkpointing)
    recomputed = sum(profile.block_bytes[::every]) if every else 0

    def rate(measured: float) -> Callable[[int, bool], float]:
        return lambda ranks, across: placement.per_byte(measured, profile, ranks, across)

    allreduce = rate(profile.allreduce_s_per_byte)

    # the wing's memory and communication (engine/parallel/: `Strategy.cost`)
    cost = wing.cost(
        CostShape(
            params=P,
            workers=n,
            data_parallel=c.data_parallel,
            shard_ranks=c.shard_ranks,
            replicate=c.replicate,
            micro_steps=a,
            slots=profile.optimizer_slots,
            gpu=profile.device == "cuda",
            offload=c.offload,
            grad_sync=c.grad_sync,
            zero_stage=c.zero_stage,
            reshard_after_forward=reshard_after_forward,
            bf16_gathers=bf16_gathers,
            largest_unit=profile.largest_unit_bytes * keep,
            recomputed=recomputed * keep,
            units=max(1, round(profile.units * stage)),
            latency_s=profile.latency_s,
            allreduce=allreduce,
            gather=rate(profile.gather_s_per_byte),
            crosses=crosses,
            host_link=HOST_LINK_BYTES_PER_S,
        )
    )
    activations = profile.activation_bytes[key].at(m) * keep * mesh.in_flight(a)
    memory = cost.states + cost.gathered + activations
    compute = a * profile.compute_s[key].at(m) * keep / (1 - mesh.bubble(a))
    comm = cost.comm_s
    if pp > 1:
        sends = 2 * a * mesh.stages_per_rank
        per_byte = allreduce(2, crosses)
        comm += sends * (m * pipeline_plan.bytes_per_sample * per_byte + profile.latency_s)
    if tp > 1:
        # the group's all-reduces, every layer of every micro-step, on one node's links
        per_byte = allreduce(tp, False)
        comm += a * (
            m * tensor_plan.bytes_per_sample * per_byte + tensor_plan.allreduces * profile.latency_s
        )
    optimizer = profile.optimizer_s * keep / cost.optimizer_ranks
    fixed, per_micro = profile.overheads.get(c.overhead_label, (0.0, 0.0))
    step = compute + comm + optimizer + fixed + a * per_micro
    # ------------------------------------------------------------------ fits?
    why = None
    if failed is not None and m >= failed:
        why = f"micro-batch {failed} ran out of memory in the profile"
    elif profile.memory_bytes and memory > profile.memory_bytes:
        why = f"needs {_mib(memory)} MiB per rank, the budget is {_mib(profile.memory_bytes)} MiB"
    return Prediction(memory, step, compute, comm, why is None, why)
