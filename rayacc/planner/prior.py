"""The analytic prior: memory per rank and step time of a candidate, from a measured profile.

Memory per rank (what the auto search's probe counts, engine/autobatch.py):
- parameters, gradients and optimizer state: whole under DDP; sharded over n under FSDP,
  except `window_end`'s gradients, held whole across the window; under DeepSpeed ZeRO the
  optimizer's fp32 master partition and its state sharded (stage 1), the gradients too
  (stage 2), the parameters too (stage 3, gathered as FSDP's are); with the optimizer
  offloaded its partition and state live in host memory (spared on a GPU; on a CPU worker
  the host is the device);
- FSDP's gathered weights: every unit's once in the CPU count (each is saved for backward,
  except by the blocks activation checkpointing recomputes),
  the two largest units on a GPU with `reshard_after_forward` (one in use, one prefetched);
  half of it under bf16 mixed precision;
- DDP's gradient buckets on a GPU (a copy of the gradients the all-reduce reads);
- the activations of one micro-batch, measured on the plain model at a few sizes.

Step time of a window of a micro-steps of m:
- compute: a × (one forward + backward at m), measured per checkpointing setting (so the
  recomputation is measured, not modelled);
- communication: DDP one all-reduce of the gradients; FSDP every micro-step's gathers (twice
  with `reshard_after_forward`) and reduce-scatters (`every_micro_step`) or one reduce-scatter
  (`window_end`); ZeRO-1 one all-reduce per window, ZeRO-2 a reduce per micro-step and the
  gather of the updated parameters, ZeRO-3 FSDP's `every_micro_step` (as measured under
  rayacc's window, docs/design.md); each costs its bytes at the measured rate, scaled from the
  profile's ranks to n by the ring's (n-1)/n, plus a launch per unit;
- the optimizer step (1/n of it under FSDP), and the strategy's fixed costs per window and
  per micro-step, measured on real windows.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayacc.planner.candidates import Candidate
from rayacc.planner.profile import Profile, checkpointing_every

__all__ = ["Prediction", "predict"]


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


def predict(
    c: Candidate,
    profile: Profile,
    *,
    reshard_after_forward: bool = True,
    bf16_gathers: bool = False,
) -> Prediction:
    """The prior of `c` (the profile was measured at the most workers any candidate has)."""
    key = str(c.checkpointing)
    P, n, m, a = profile.param_bytes, c.workers, c.micro_batch_size, c.grad_accum_steps
    slots = profile.optimizer_slots
    failed = profile.failed.get(key)
    if key not in profile.compute_s:
        inf = float("inf")
        return Prediction(inf, inf, 0.0, 0.0, False, "out of memory in the profile")
    # ------------------------------------------------------------------ memory
    gathered = 0.0
    zero = c.zero_stage if c.strategy == "deepspeed" else None
    # ZeRO's fp32 master partition and the optimizer's state of it (in host memory when
    # offloaded: spared on a GPU, still there on a CPU worker)
    master = 0.0 if (c.offload and profile.device == "cuda") else (1 + slots) * P / n
    if c.strategy == "ddp":
        states = (2 + slots) * P
        if profile.device == "cuda" and n > 1:
            states += P  # gradient buckets
    elif zero in (1, 2):
        states = P + (P if zero == 1 else P / n) + master
    else:
        shard = P / n
        if zero == 3:
            states = 2 * shard + master  # parameter and gradient shards
        else:
            grads = P if c.grad_sync == "window_end" else shard
            states = (1 + slots) * shard + grads
        if profile.device == "cuda" and reshard_after_forward:
            gathered = min(P, 2 * profile.largest_unit_bytes)
        else:
            # a recomputed block saves only its input in forward, not its gathered weights
            every = checkpointing_every(c.checkpointing)
            recomputed = profile.block_bytes[::every] if every else []
            gathered = P - sum(recomputed)
        gathered *= 0.5 if bf16_gathers else 1.0
    memory = states + gathered + profile.activation_bytes[key].at(m)
    # ------------------------------------------------------------------ time
    compute = a * profile.compute_s[key].at(m)
    latency = profile.latency_s
    scaled_ar = _scaled(profile.allreduce_s_per_byte, profile, n)
    scaled_g = _scaled(profile.gather_s_per_byte, profile, n)
    if n == 1:
        comm = 0.0
    elif c.strategy == "ddp" or zero == 1:
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
    optimizer = profile.optimizer_s / (1 if c.strategy == "ddp" else n)
    fixed, per_micro = profile.overheads.get(c.strategy_label, (0.0, 0.0))
    step = compute + comm + optimizer + fixed + a * per_micro
    # ------------------------------------------------------------------ fits?
    why = None
    if failed is not None and m >= failed:
        why = f"micro-batch {failed} ran out of memory in the profile"
    elif profile.memory_bytes and memory > profile.memory_bytes:
        why = f"needs {_mib(memory)} MiB per rank, the budget is {_mib(profile.memory_bytes)} MiB"
    return Prediction(memory, step, compute, comm, why is None, why)
