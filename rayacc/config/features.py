"""The one acceptance of feature pairs. Every feature a config can turn on (a strategy, a degree
of the mesh, a precision, LoRA, an objective, a batch schedule, an elastic range, a kind of
data …) declares the features it composes with; a pair is accepted when both sides declare it
and refused before launch otherwise, naming both keys, why and the fix. A strategy declares by
exception (its wing's `without_*` and `refuses`: a plugin strategy composes with what it does
not refuse); every other feature lists the features it composes with, so tomorrow's feature is
refused with everything until it says otherwise. Value rules (a degree dividing the worker
count, whole heads per rank) stay with their sections."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rayacc.config.errors import ConfigIssue
from rayacc.config.mesh import Mesh
from rayacc.config.strategies import strategies

__all__ = ["DATA", "DataKind", "Feature", "composition_issues", "declared", "features"]

Sections = Mapping[str, Any]


DATA = ("packed", "masked")
"""The features the data's kind turns on (read where the data is: `prepare`, `plan`)."""


@dataclass(frozen=True)
class DataKind:
    """What the rows of `data.source` are, as read from its columns (the driver reads them)."""

    packed: bool = False
    """`documents`: packed examples (`rayacc data prepare --pack`)."""
    masked: bool = False
    """`loss_mask`: only the marked tokens count (instruction data)."""


@dataclass(frozen=True)
class Feature:
    name: str
    key: str
    """The config key a message names."""
    on: Callable[[Sections, DataKind | None], bool]
    """Whether the config (its valid sections, and the data's kind where read) turns it on."""
    given: Callable[[Sections], str]
    """`key=value` as a message quotes it."""
    off: str
    """How to turn it off (the fix names it)."""
    composes: frozenset[str]
    """The features it is built and proven with."""
    refuses: Mapping[str, str] = field(default_factory=dict)
    """Why it does not compose with a feature it leaves out (the message says it)."""
    turn_on: Mapping[str, Any] = field(default_factory=dict)
    """Dotted keys that turn it on in a config that holds it (`packed`/`masked`: the data's)."""


def _get(sections: Sections, dotted: str) -> Any:
    section, _, name = dotted.partition(".")
    value = sections.get(section)
    return getattr(value, name, None) if value is not None else None


def _is(dotted: str, test: Callable[[Any], bool]) -> Callable[[Sections, Any], bool]:
    def on(sections: Sections, data: DataKind | None) -> bool:
        value = _get(sections, dotted)
        return value is not None and test(value)

    return on


def _quote(dotted: str) -> Callable[[Sections], str]:
    return lambda sections: f"{dotted}={_get(sections, dotted)!r}"


def _data(kind: str) -> Callable[[Sections, DataKind | None], bool]:
    return lambda sections, data: data is not None and getattr(data, kind)


# ----------------------------------------------------------------------------- the features
TENSOR, PIPELINE = Mesh.key("tensor"), Mesh.key("pipeline")
_BUFFERS = "a pipeline sizes its stages' buffers for one count of micro-steps, and "
_ELASTIC = "an elastic group's size cannot be held to multiples of it"
_OTHERS = (
    "tensor", "pipeline", "fp16", "bf16", "lora", "objective", "recompute", "compile",
    "auto_micro", "phases", "auto_schedule", "balance", "elastic", "packed", "masked",
)  # fmt: skip
"""The features besides the strategies, in the order messages take them."""


_CHANGES_STEPS = {
    "phases": "batch.schedule changes the global batch",
    "auto_schedule": "batch.schedule changes the global batch",
    "balance": "batch.balance: auto moves rows between ranks, which may change a window's "
    "micro-steps",
}
"""The features that change a window's micro-steps within a worker group, and how."""


def _all_but(*names: str) -> frozenset[str]:
    """Every strategy and every other feature but `names` (itself included: a feature never
    meets itself, one key holding one value)."""
    return frozenset(("strategy", *_OTHERS)) - set(names)


def _others() -> tuple[Feature, ...]:
    degree = {
        d: (lambda s, data, d=d: getattr(Mesh.of_sections(s.get("train")), d) > 1)
        for d in ("tensor", "pipeline")
    }
    return (
        Feature("tensor", TENSOR, degree["tensor"], _quote(TENSOR), f"set {TENSOR}=1",
                _all_but("lora", "auto_schedule", "elastic"),
                {"lora": "the adapters' layers are not in the tensor-parallel plan (FSDP or "
                         "ZeRO-3 shard the base)"},
                {TENSOR: 2}),
        Feature("pipeline", PIPELINE, degree["pipeline"], _quote(PIPELINE), f"set {PIPELINE}=1",
                _all_but("phases", "auto_schedule", "balance", "auto_micro", "elastic", "packed"),
                {"balance": _BUFFERS + "moving rows between ranks may change them",
                 "auto_micro": "a pipeline sizes its stages' buffers for one micro-batch, which "
                               "a search would change",
                 "packed": "a pipeline sends each stage's activations in one shape, without "
                           "each example's attention mask"},
                {PIPELINE: 2}),
        Feature("fp16", "train.precision", _is("train.precision", lambda v: v == "fp16"),
                _quote("train.precision"), "set train.precision=bf16 (or fp32)",
                _all_but("bf16"), {}, {"train.precision": "fp16"}),
        Feature("bf16", "train.precision", _is("train.precision", lambda v: v == "bf16"),
                _quote("train.precision"), "set train.precision=fp32",
                _all_but("fp16"), {}, {"train.precision": "bf16"}),
        Feature("lora", "model.lora", _is("model.lora", lambda v: True),
                lambda s: "model.lora", "remove model.lora", _all_but("tensor"), {},
                {"model.lora": {"r": 4}}),
        Feature("objective", "train.loss", _is("train.loss", lambda v: True),
                _quote("train.loss"), "remove train.loss", _all_but(), {},
                {"train.loss": "jobs.objectives:row_mean"}),
        Feature("recompute", "train.activation_checkpointing",
                _is("train.activation_checkpointing", lambda v: v != "none"),
                _quote("train.activation_checkpointing"),
                "set train.activation_checkpointing=none", _all_but(), {},
                {"train.activation_checkpointing": "full"}),
        Feature("compile", "train.compile", _is("train.compile", bool), _quote("train.compile"),
                "set train.compile=false", _all_but(), {}, {"train.compile": True}),
        Feature("auto_micro", "batch.micro_batch_size",
                _is("batch.micro_batch_size", lambda v: v == "auto"),
                _quote("batch.micro_batch_size"), "give batch.micro_batch_size a number",
                _all_but("pipeline", "phases", "auto_schedule"),
                {"phases": "the search sizes one share before training, and batch.schedule "
                           "changes the global batch",
                 "auto_schedule": "the search sizes one share before training, and "
                                  "batch.schedule changes the global batch"},
                {"batch.micro_batch_size": "auto", "batch.memory_budget_mb": 512}),
        Feature("phases", "batch.schedule", _is("batch.schedule", lambda v: v and v != "auto"),
                lambda s: "batch.schedule (phases)", "give one global batch (no batch.schedule)",
                _all_but("pipeline", "auto_micro"),
                {"pipeline": _BUFFERS + "batch.schedule changes the accumulation"},
                {"batch.schedule": [{"from_samples": 64, "global_batch_size": 64}]}),
        Feature("auto_schedule", "batch.schedule", _is("batch.schedule", lambda v: v == "auto"),
                _quote("batch.schedule"), "give batch.schedule its phases, or none",
                _all_but("pipeline", "auto_micro", "tensor"),
                {"pipeline": _BUFFERS + "batch.schedule changes the accumulation",
                 "tensor": "it measures no gradient noise scale, which batch.schedule: auto "
                           "follows"},
                {"batch.schedule": "auto", "batch.max_global_batch_size": 64,
                 "train.max_steps": None, "train.epochs": 1}),
        Feature("balance", "batch.balance", _is("batch.balance", lambda v: v == "auto"),
                _quote("batch.balance"), "set batch.balance=off", _all_but("pipeline"), {},
                {"batch.balance": "auto"}),
        Feature("elastic", "scaling.num_workers", _is("scaling.num_workers", lambda v: v and
                                                      isinstance(v, tuple | list)),
                _quote("scaling.num_workers"), "give scaling.num_workers one count",
                _all_but("tensor", "pipeline"), {"tensor": _ELASTIC, "pipeline": _ELASTIC},
                {"scaling.num_workers": [2, 4]}),
        Feature("packed", "data.source", _data("packed"),
                lambda s: "packed rows (`documents`)",
                "prepare the data without --pack", _all_but("pipeline"), {}),
        Feature("masked", "data.source", _data("masked"),
                lambda s: "masked rows (`loss_mask`)",
                "prepare the data without a loss_mask", _all_but(), {}),
    )  # fmt: skip


def _strategy(name: str) -> Feature:
    """A strategy's feature: it composes with every feature its wing does not refuse."""
    entry = strategies()[name]
    refuses = dict(entry.refuses)
    for kind in ("tensor", "pipeline"):
        if (why := getattr(entry, f"without_{kind}_parallel")) is not None:
            refuses[kind] = why
    if entry.fixed_accumulation is not None:
        for other, what in _CHANGES_STEPS.items():
            refuses[other] = f"{entry.fixed_accumulation}, and {what}"
    return Feature(
        name,
        "train.strategy",
        _is("train.strategy", lambda v: v == name),
        lambda s: f"train.strategy={name}",
        "use another train.strategy",
        frozenset(_OTHERS) - set(refuses),
        refuses,
        {"train.strategy": name},
    )


def features() -> dict[str, Feature]:
    """Every feature by name: the strategies (the registry's, plugins too), then the others."""
    found = {name: _strategy(name) for name in strategies()}
    for f in _others():
        found[f.name] = f
    return found


def _composes(a: Feature, b: Feature) -> bool:
    strategy = set(strategies())
    sides = [(a, b), (b, a)]
    return all(
        o.name in f.composes or (o.name in strategy and "strategy" in f.composes) for f, o in sides
    )


def declared(a: str, b: str) -> bool:
    """Whether features `a` and `b` declare each other (the pair is accepted)."""
    found = features()
    return _composes(found[a], found[b])


def composition_issues(sections: Sections, data: DataKind | None = None) -> list[ConfigIssue]:
    """One issue per pair of features the config turns on that do not declare each other,
    named at the key of the one refused (the other says why). `data` None: the data's kind is
    not read here, and the pairs it brings are judged where it is."""
    on = [f for f in features().values() if f.on(sections, data)]
    if data is not None:
        only = {f.name for f in on if f.name in DATA}
        pairs = [(a, b) for i, a in enumerate(on) for b in on[i + 1 :] if {a.name, b.name} & only]
    else:
        pairs = [(a, b) for i, a in enumerate(on) for b in on[i + 1 :]]
    issues = []
    for a, b in pairs:
        if a.key == b.key or _composes(a, b):
            continue
        refuser, refused = (a, b) if b.name in a.refuses else (b, a)
        why = refuser.refuses.get(refused.name, "the two are not declared to compose")
        issues.append(
            ConfigIssue(
                refused.key,
                f"{_holds(refused, sections)}does not compose with {refuser.given(sections)}: "
                f"{why}",
                _value(sections, refused),
                f"{refused.off}, or {_off(refuser, refused).removeprefix('set ')}",
            )
        )
    return issues


def _off(refuser: Feature, refused: Feature) -> str:
    """How to turn `refuser` off for `refused`: a strategy names those that compose with it."""
    if refuser.key != "train.strategy":
        return refuser.off
    found = features()
    able = [n for n in strategies() if _composes(found[n], refused)]
    return f"use train.strategy={' or '.join(able)}" if able else refuser.off


def _holds(f: Feature, sections: Sections) -> str:
    """A kind of data is named by what the source holds."""
    return f"holds {f.given(sections)}, which " if f.name in DATA else ""


def _value(sections: Sections, f: Feature) -> Any:
    from rayacc.config.errors import MISSING

    if f.key == "model.lora":
        return MISSING
    value = _get(sections, f.key)
    return list(value) if isinstance(value, tuple) else value
