"""The analytic prior: memory per rank and step time of a candidate, from a measured profile.

More: docs/design.md, "Notes from the code" (planner/prior.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayacc.engine.parallel import strategy_class
from rayacc.planner.candidates import Candidate, nodes_spanned
from rayacc.planner.profile import Profile, checkpointing_every

__all__ = ["HOST_LINK_BYTES_PER_S", "Placement", "Prediction", "TensorPlan", "predict"]


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


def predict(
    c: Candidate,
    profile: Profile,
    *,
    reshard_after_forward: bool = True,
    bf16_gathers: bool = False,
    placement: Placement = Placement(),
    tensor_plan: TensorPlan | None = None,
) -> Prediction:
    """The prior of `c` (the profile was measured at the most workers any candidate has, on
    the whole model). A tensor-parallel candidate (`tensor_plan` says what splits): each rank
    holds, computes and keeps the activations of its share of the model (`TensorPlan.keep`:
    the attention scores and the layers left whole are counted as split, an optimistic
    bound), FSDP shards that share over the data-parallel ranks, and the group's all-reduces
    run at the profile's rate on one node's links."""
    key = str(c.checkpointing)
    kind = strategy_class(c.strategy).prior  # what the wing declares: replicated, sharded, zero
    tp = c.tensor_parallel
    if tp > 1 and tensor_plan is None:
        raise ValueError(f"{c.label}: a tensor-parallel candidate needs the model's TensorPlan")
    keep = tensor_plan.keep(tp) if tp > 1 else 1.0
    P, n, m, a = profile.param_bytes * keep, c.workers, c.micro_batch_size, c.grad_accum_steps
    # FSDP shards over its shard group (all n but under HSDP), which crosses nodes unless
    # HSDP keeps it inside one
    s = c.shard_ranks if kind == "sharded" else n
    dp = c.data_parallel
    crosses = placement.nodes(n) > 1
    shard_crosses = crosses and c.replicate == 1
    on_host = c.offload and kind == "sharded" and profile.device == "cuda"
    slots = profile.optimizer_slots
    failed = profile.failed.get(key)
    if key not in profile.compute_s:
        inf = float("inf")
        return Prediction(inf, inf, 0.0, 0.0, False, "out of memory in the profile")
    # ------------------------------------------------------------------ memory
    gathered = 0.0
    zero = c.zero_stage if kind == "zero" else None
    # ZeRO's fp32 master partition and the optimizer's state of it (in host memory when
    # offloaded: spared on a GPU, still there on a CPU worker)
    master = 0.0 if (c.offload and profile.device == "cuda") else (1 + slots) * P / n
    if kind == "replicated":
        states = (2 + slots) * P
        if profile.device == "cuda" and n > 1:
            states += P  # gradient buckets
    elif zero in (1, 2):
        states = P + (P if zero == 1 else P / n) + master
    else:
        shard = P / (n if zero == 3 else s)
        if zero == 3:
            states = 2 * shard + master  # parameter and gradient shards
        else:
            # offloaded: the shards, their gradients and the optimizer's state in host memory
            # (`window_end`'s unsharded gradients stay on the device across the window)
            held = 0.0 if on_host else shard
            grads = P if c.grad_sync == "window_end" else held
            states = (0.0 if on_host else (1 + slots) * shard) + grads
        if profile.device == "cuda" and reshard_after_forward:
            gathered = min(P, 2 * profile.largest_unit_bytes * keep)
        else:
            # a recomputed block saves only its input in forward, not its gathered weights
            every = checkpointing_every(c.checkpointing)
            recomputed = profile.block_bytes[::every] if every else []
            gathered = P - sum(recomputed) * keep
        gathered *= 0.5 if bf16_gathers else 1.0
    memory = states + gathered + profile.activation_bytes[key].at(m) * keep
    # ------------------------------------------------------------------ time
    compute = a * profile.compute_s[key].at(m) * keep
    latency = profile.latency_s
    scaled_ar = placement.per_byte(profile.allreduce_s_per_byte, profile, dp, crosses)
    scaled_g = placement.per_byte(profile.gather_s_per_byte, profile, s, shard_crosses)
    if n == 1:
        comm = 0.0
    elif kind == "replicated" or zero == 1:
        comm = latency + P * scaled_ar
    elif zero == 2:
        comm = (a + 1) * (P * scaled_g + latency)
    else:
        bytes_gathered = P * (0.5 if bf16_gathers else 1.0)
        gathers = (2 if reshard_after_forward else 1) * (
            bytes_gathered * scaled_g + profile.units * latency
        )
        reduce_scatter = P * scaled_g + profile.units * latency
        syncs = 1 if c.grad_sync == "window_end" else a
        comm = a * gathers + syncs * reduce_scatter
        if c.replicate > 1:
            # HSDP: the sharded gradients all-reduced across the replica groups (the nodes)
            # once per window
            per_byte = placement.per_byte(
                profile.allreduce_s_per_byte, profile, c.replicate, crosses
            )
            comm += (P / s) * per_byte + profile.units * latency
        if on_host:
            # each micro-step's parameter shards in (twice with resharding) and gradient
            # shards out
            moves = (2 if reshard_after_forward else 1) + 1
            comm += a * moves * (P / s) / HOST_LINK_BYTES_PER_S
    if tp > 1:
        # the group's all-reduces, every layer of every micro-step, on one node's links
        per_byte = placement.per_byte(profile.allreduce_s_per_byte, profile, tp, False)
        comm += a * (m * tensor_plan.bytes_per_sample * per_byte + tensor_plan.allreduces * latency)
    optimizer = profile.optimizer_s * keep / (1 if kind == "replicated" else s)
    fixed, per_micro = profile.overheads.get(c.overhead_label, (0.0, 0.0))
    step = compute + comm + optimizer + fixed + a * per_micro
    # ------------------------------------------------------------------ fits?
    why = None
    if failed is not None and m >= failed:
        why = f"micro-batch {failed} ran out of memory in the profile"
    elif profile.memory_bytes and memory > profile.memory_bytes:
        why = f"needs {_mib(memory)} MiB per rank, the budget is {_mib(profile.memory_bytes)} MiB"
    return Prediction(memory, step, compute, comm, why is None, why)
