"""The combination matrix: every accepted combination of strategy, activation checkpointing,
micro-batch, workers, precision, loss, last window, resume event, shares (even or uneven),
objective (tokens or a user's counting rows), LoRA adapters (off or on) and data (padded, or
masked as instruction data is), covered pairwise
(the pairs the validator refuses left out and checked refused), each case
run on gloo ranks (no Ray) through the product's own build path (`build_rank`: strategy,
model, optimizer, losses and the accumulation step), and compared with single-process
full-batch steps.

A case runs in two phases when it has an event: phase A trains its first window and saves the
model and optimizer state through the strategy (a sharded checkpoint under FSDP), phase B
builds a fresh model at the resume size, loads it, runs the auto search again if the case has
one, and trains the rest. Cases are grouped by the number of ranks of each phase, so a whole
matrix costs at most six spawns of rank processes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tests.support.ranks.engine_helpers import full_weights

FACTORS: dict[str, tuple] = {
    "strategy": ("ddp", "fsdp every_micro_step", "fsdp window_end"),
    "recompute": ("none", "full"),
    "micro": ("fixed", "auto"),
    "workers": (1, 2, 3),
    "precision": ("fp32", "bf16"),
    "loss": ("plain", "chunked"),
    "last": ("full", "short"),
    "event": ("none", "resume same size", "resume other size"),
    "shares": ("even", "uneven"),
    "objective": ("tokens", "rows"),
    "lora": ("off", "on"),
    "data": ("padded", "masked"),
}

KEYS = {
    "strategy": "train.strategy", "recompute": "train.activation_checkpointing",
    "micro": "batch.micro_batch_size", "workers": "scaling.num_workers",
    "precision": "train.precision", "loss": "train.loss_chunk_tokens", "last": "data.last_window",
    "event": "scaling.num_workers", "shares": "batch.global_batch_size", "objective": "train.loss",
    "lora": "model.lora", "data": "data.source",
}  # fmt: skip
"""The config key each factor sets (a refusal names it)."""

VOCAB, BLOCK = 16, 16
GLOBAL = 12
"""Sequences per window: 12 rows divide over 1, 2 and 3 ranks."""
UNEVEN = 11
"""Sequences per window where the shares are uneven: 6 + 5 over 2 ranks, 4 + 4 + 3 over 3."""
ROW_OBJECTIVE = "tests.support.ranks.pipeline:row_mean"
"""The user objective counting rows (one item a row)."""
MICRO = 2
LR, MOMENTUM = 0.5, 0.9
CHUNK = 5
"""Positions per chunk of the chunked loss: windows hold 2–16 positions per row, so chunks
straddle rows and padding."""
OTHER_SIZE = {1: 2, 2: 3, 3: 2}
"""The size a case resumes at when its event is a resume at another size."""


def all_pairs(factors: dict[str, tuple]) -> set:
    names = list(factors)
    return {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
    }


@functools.cache
def refused_pairs() -> dict:
    """The pairs of values the product's validator refuses whatever the other factors are,
    each with its last message (generated from the validator, not listed): the full cases
    holding a pair are validated until one is accepted."""
    from rayacc.config import ConfigError

    found = {}
    for pair in sorted(all_pairs(FACTORS), key=str):
        rest = {k: v for k, v in FACTORS.items() if k not in dict(pair)}
        last = ""
        for combo in itertools.product(*rest.values()):
            try:
                config(Case(-1, **dict(zip(rest, combo)), **dict(pair)))
                break
            except ConfigError as exc:
                last = str(exc)
        else:
            found[pair] = last
    return found


def pairwise(factors: dict[str, tuple], seed: int = 0) -> list[dict]:
    """A small set of cases in which every pair of values of every two factors that the product
    accepts appears at least once (a covering array of strength 2), built greedily: each new
    case is the candidate that covers the most pairs not yet covered, candidates being every
    full combination that holds no refused pair (one the validator refuses as a whole is
    passed over). Deterministic."""
    names = list(factors)
    refused = set(refused_pairs())
    uncovered = all_pairs(factors) - refused
    space = [
        case
        for combo in itertools.product(*factors.values())
        if not _holds_any(case := dict(zip(names, combo)), refused)
    ]
    cases = []
    while uncovered:

        def gain(case: dict) -> int:
            return sum(
                ((a, case[a]), (b, case[b])) in uncovered
                for a, b in itertools.combinations(names, 2)
            )

        best = max(space, key=gain)
        space.remove(best)
        if not _accepted(best):  # refused by three or more of its values together
            continue
        cases.append(best)
        for a, b in itertools.combinations(names, 2):
            uncovered.discard(((a, best[a]), (b, best[b])))
    return cases


def _accepted(case: dict) -> bool:
    """Whether the validator takes the full case (a strategy of another package, not
    registered in this process, judged as the first built-in one: it declares the same)."""
    from rayacc.config import ConfigError
    from rayacc.config.strategies import strategies

    if case["strategy"].partition(" ")[0] not in strategies():
        case = {**case, "strategy": FACTORS["strategy"][0]}
    try:
        config(Case(-1, **case))
    except ConfigError:
        return False
    return True


def _holds_any(case: dict, pairs: set) -> bool:
    return any(
        ((a, case[a]), (b, case[b])) in pairs for a, b in itertools.combinations(list(case), 2)
    )


def uncovered_pairs(factors: dict[str, tuple], cases: list[dict]) -> list:
    """The accepted pairs of values no case holds (empty for a pairwise covering)."""
    return [
        ((a, va), (b, vb))
        for (a, va), (b, vb) in sorted(all_pairs(factors) - set(refused_pairs()), key=str)
        if not any(c[a] == va and c[b] == vb for c in cases)
    ]


@dataclass(frozen=True)
class Case:
    index: int
    strategy: str
    recompute: str
    micro: str
    workers: int
    precision: str
    loss: str
    last: str
    event: str
    shares: str = "even"
    objective: str = "tokens"
    lora: str = "off"
    data: str = "padded"
    """`padded` rows of variable length, or `masked`: the first half of each row's targets
    not counted (a prompt), as a `loss_mask` leaves them."""

    @property
    def rows(self) -> int:
        """Sequences per full window."""
        return UNEVEN if self.shares == "uneven" else GLOBAL

    @property
    def resume_workers(self) -> int | None:
        if self.event == "none":
            return None
        return self.workers if self.event == "resume same size" else OTHER_SIZE[self.workers]

    def label(self) -> str:
        return " | ".join(str(v) for k, v in asdict(self).items() if k != "index")


def cases(factors: dict[str, tuple] | None = None) -> list[Case]:
    """The pairwise cases of `factors` (the matrix's own by default)."""
    return [Case(i, **c) for i, c in enumerate(pairwise(factors or FACTORS))]


def added_strategy_cases(name: str, first_index: int) -> list[Case]:
    """The cases a strategy value `name` added to the matrix brings (its pairs with every other
    factor's values), numbered from `first_index`."""
    factors = {**FACTORS, "strategy": (*FACTORS["strategy"], name)}
    mine = [c for c in cases(factors) if c.strategy == name]
    return [dataclasses.replace(c, index=first_index + i) for i, c in enumerate(mine)]


def windows(case: Case) -> list[list[torch.Tensor]]:
    """Three windows of variable-length sequences; with a short last window the third holds 7
    (not a multiple of any worker count or of the micro-batch)."""
    from tests.support.ranks.engine_helpers import token_sequences

    sizes = [case.rows, case.rows, 7 if case.last == "short" else case.rows]
    seqs = token_sequences(sum(sizes), seed=31, min_len=2, max_len=BLOCK + 1)
    seqs = [s.clamp(max=VOCAB - 1) for s in seqs]
    out, at = [], 0
    for n in sizes:
        out.append(seqs[at : at + n])
        at += n
    return out


def config(case: Case, rules: bool = True):
    """The run's config of a case (the product's own validation applies; `rules` False: the
    fields' alone, for a base another harness changes before it runs)."""
    from rayacc.config import TrainConfig

    strategy, _, grad_sync = case.strategy.partition(" ")
    return (TrainConfig.from_dict if rules else TrainConfig.model_validate)(
        {
            "seed": 5,
            "model": {
                **{"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": BLOCK},
                **({"lora": {"r": 2, "alpha": 4}} if case.lora == "on" else {}),
            },
            "data": {"seq_len": BLOCK},
            "batch": {
                "global_batch_size": case.rows,
                "micro_batch_size": "auto" if case.micro == "auto" else MICRO,
                **({"memory_budget_mb": 4096} if case.micro == "auto" else {}),
            },
            "scaling": {"num_workers": case.workers},
            "optim": {"name": "sgd", "lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0},
            "train": {
                "strategy": strategy,
                "precision": case.precision,
                "activation_checkpointing": case.recompute,
                "loss_chunk_tokens": CHUNK if case.loss == "chunked" else None,
                **({"loss": ROW_OBJECTIVE} if case.objective == "rows" else {}),
            },
            **({"fsdp": {"grad_sync": grad_sync}} if grad_sync else {}),
        }
    )


def dataset():
    from rayacc.data.sources import DatasetInfo

    return DatasetInfo(
        path="tokens.parquet", format="tokens", num_rows=64, vocab_size=VOCAB, max_tokens=BLOCK + 1
    )


def rank_share(window: list, rank: int, world: int) -> list:
    """Contiguous share, the first ranks one more when the window does not divide (the data
    order's rule)."""
    base, extra = divmod(len(window), world)
    lo = rank * base + min(rank, extra)
    return window[lo : lo + base + (1 if rank < extra else 0)]


def collate(seqs: list, masked: bool = False) -> dict:
    """Rows padded into a batch; `masked`: the first half of each row's targets not counted."""
    from rayacc.engine import IGNORE_INDEX, collate_tokens

    batch = collate_tokens(seqs)
    if masked:
        for r, seq in enumerate(seqs):
            batch["target"][r, : (len(seq) - 1) // 2] = IGNORE_INDEX
    return batch


def micro_batches(
    seqs: list, micro: int, world: int, window_len: int, masked: bool = False
) -> list[dict]:
    """This rank's share cut into as many micro-batches as every rank runs."""
    steps = math.ceil(math.ceil(window_len / world) / micro)
    parts = torch.tensor_split(torch.arange(len(seqs)), steps)
    return [collate([seqs[int(i)] for i in part], masked) for part in parts if len(part)]


def run_phase(case: Case, rank: int, world: int, folder: Path, phase: str) -> dict | None:
    """Runs this rank's part of a case's phase; rank 0 returns the full weights at its end."""
    from rayacc.engine import find_micro_batch_size
    from rayacc.optim import optimizer_slots
    from rayacc.rank.build import build_rank

    cfg, info = config(case), dataset()
    device = torch.device("cpu")
    parts = build_rank(cfg, info, device, LR)
    strategy, optimizer, step = parts.strategy, parts.optimizer, parts.accumulate
    loss_fn, count = parts.loss_fn, parts.count
    todo = phase_windows(strategy, strategy.model, optimizer, folder, rank, phase,
                         windows(case), resumes=case.event != "none")  # fmt: skip

    micro = MICRO
    if case.micro == "auto":
        share = rank_share(todo[0], rank, world)
        share_rows = math.ceil(case.rows / world)

        def make_batch(n: int):
            from rayacc.engine import collate_tokens

            return collate_tokens([share[i % len(share)] for i in range(n)])

        found = find_micro_batch_size(
            strategy.unwrapped(),
            loss_fn,
            make_batch,
            samples_per_worker=share_rows,
            budget_bytes=4096 * 2**20,
            optimizer_slots=optimizer_slots(cfg.optim),
            strategy=strategy,
        )
        micro = found.micro_batch_size
    signals = []
    for i, window in enumerate(todo):
        mine = rank_share(window, rank, world)
        # the last rank raises a signal in every other window: every rank must count it there
        raised = rank == world - 1 and i % 2 == 0
        mbs = micro_batches(mine, micro, world, len(window), case.data == "masked")
        result = step(mbs, loss_fn, count, signal=raised)
        signals.append(result.signals)
    if phase == "A" and case.event != "none":
        save_for_phase_b(strategy, strategy.model, optimizer, folder, rank)
        return None
    full = full_weights(strategy.unwrapped())  # a collective under FSDP: every rank gathers
    ran = f"{type(strategy).__module__}:{type(strategy).__qualname__}"
    return {"params": full, "signals": signals, "strategy": ran} if rank == 0 else None


def _broadcast(saved: dict, rank: int) -> dict:
    """Rank 0's whole state to every rank (each reads the checkpoint's shared state file)."""
    import torch.distributed as dist

    box = [saved]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reference(case: Case, cfg=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(initial, final) weights of the same SGD steps, each on a whole window in one process,
    in float32 with the plain loss: the yardstick of every case (`cfg`: the case's config where
    not the matrix's)."""
    import torch.nn.functional as F

    from rayacc.engine import IGNORE_INDEX
    from rayacc.models import build_model

    # strategy-free: one process, whole windows (a strategy of another package included)
    cfg = cfg or config(dataclasses.replace(case, strategy=FACTORS["strategy"][0]))
    model = build_model(cfg, dataset())
    before = full_weights(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for window in windows(case):
        batch = collate(window, case.data == "masked")
        logits = model(batch["input"])
        if case.objective == "rows":  # the mean of the rows' means: one item a row
            from tests.support.ranks.pipeline import row_mean

            total, rows = row_mean(logits, batch)
            loss = total / rows
        else:
            loss = F.cross_entropy(
                logits.reshape(-1, VOCAB), batch["target"].reshape(-1), ignore_index=IGNORE_INDEX
            )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return before, full_weights(model)


def phase_groups(all_cases: list[Case]) -> list[tuple[str, int, list[Case]]]:
    """(phase, ranks, cases): every phase A first (a phase B loads what its A saved)."""
    groups = []
    for phase in ("A", "B"):
        for world in (1, 2, 3):
            if phase == "A":
                chosen = [c for c in all_cases if c.workers == world]
            else:
                chosen = [c for c in all_cases if c.resume_workers == world]
            if chosen:
                groups.append((phase, world, chosen))
    return groups


def phase_windows(
    strategy,
    model,
    optimizer,
    folder: Path,
    rank: int,
    phase: str,
    all_windows: list,
    *,
    resumes: bool,
) -> list:
    """The windows a case's `phase` runs on this rank: a resumed case's first alone (A), then
    the rest from the state A saved, read on rank 0 and handed to every rank (B); else all."""
    if phase == "B":
        saved = torch.load(folder / "state.pt", weights_only=True) if rank == 0 else {}
        strategy.state.load(model, optimizer, folder, _broadcast(saved, rank))
        return all_windows[1:]
    return all_windows[:1] if resumes else all_windows


def save_for_phase_b(strategy, model, optimizer, folder: Path, rank: int) -> None:
    """The state after phase A's windows: every rank's shards, and rank 0's whole part."""
    whole, _ = strategy.state.save(model, optimizer, folder, rank)
    if rank == 0:
        torch.save(whole, folder / "state.pt")


def spawn_phase_groups(root: Path, groups, what: str, body=None) -> dict[int, dict]:
    """Rank 0's results of every case, by index: one spawn of ranks per (phase, ranks, cases)
    of `groups` (an empty one skipped), each case's phase run by `body` (`run_phase`)."""
    from tests.support.ranks.engine_helpers import spawn_ranks

    done: dict[int, dict] = {}
    for phase, world, chosen in groups:
        if not chosen:
            continue
        folder = root / f"{phase}{world}"
        folder.mkdir()
        target = functools.partial(run_group, phase=phase, chosen=chosen, body=body)
        ranks = spawn_ranks(target, world, folder, f"{what} {phase} on {world} ranks")
        assert "error" not in ranks[0], ranks[0].get("error")
        done.update({i: v for i, v in ranks[0].items() if isinstance(i, int)})
    return done


def run_group(
    rank: int, world: int, init_file: str, out_dir: str, phase: str, chosen, body=None
) -> None:
    """Rank body: every case of one (phase, ranks) group in one gloo group (`body`: a case's
    phase on this rank, `run_phase` by default)."""
    from tests.support.ranks.dist_workers import run_scenarios

    def scenario(case: Case):
        def run(rank: int, world: int, out: dict) -> None:
            folder = Path(out_dir).parent / f"case{case.index}"
            folder.mkdir(exist_ok=True)
            got = (body or run_phase)(case, rank, world, folder, phase)
            if got is not None:
                out[case.index] = got

        return run

    run_scenarios(rank, world, init_file, out_dir, [scenario(c) for c in chosen])
