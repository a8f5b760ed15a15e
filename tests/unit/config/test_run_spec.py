"""The run derived once: `derive_run` holds every number a worker needs (the batch split at
each worker count the run may run at, the LR there, the order, the schedule's length, the
identity), and it and every error rayacc raises cross a process boundary intact (Ray pickles
the inputs of a worker group, and a worker's error on its way to the driver)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import numpy as np
import pytest

import rayacc
from rayacc import TrainConfig
from rayacc.config.batch_split import BatchSplitError
from rayacc.config.errors import ConfigError, ConfigIssue
from rayacc.data.bundled import prepare_bundled
from rayacc.driver.prelaunch import prepare
from rayacc.run.quantities import (
    RunLength,
    epoch_layout,
    run_effective_lr,
    run_identity,
    schedule_length,
    split_at,
    total_optimizer_steps,
)


def _cfg(tmp_path, **batch_and_scaling) -> TrainConfig:
    batch = {"global_batch_size": 48, "micro_batch_size": 4}
    scaling = {"num_workers": [1, 4], "on_resize": "keep_global_batch"}
    for key, value in batch_and_scaling.items():
        (scaling if key in ("num_workers", "on_resize") else batch)[key] = value
    return TrainConfig.from_dict(
        {
            "model": {"name": "mlp", "hidden_sizes": [8]},
            "data": {"source": str(prepare_bundled("digits")), "val_fraction": 0.1},
            "batch": batch,
            "optim": {"lr": 0.1, "base_batch_size": 16, "lr_scaling": "linear"},
            "train": {"epochs": 2},
            "scaling": scaling,
            "run": {"storage_path": str(tmp_path / "runs")},
        }
    )


@pytest.mark.parametrize(
    ("on_resize", "sizes"),
    [
        # 48 rows a step at every size; 4 workers cannot: 48/4 = 12, micro 4, accum 3
        ("keep_global_batch", {1: (48, 4, 12), 2: (48, 4, 6), 3: (48, 4, 4), 4: (48, 4, 3)}),
        # micro × accum stay (4 × 3 at the most workers); the global batch follows the workers
        ("keep_micro_batch", {1: (12, 4, 3), 2: (24, 4, 3), 3: (36, 4, 3), 4: (48, 4, 3)}),
    ],
)
def test_the_spec_holds_the_split_and_the_lr_at_every_size_the_run_may_take(
    tmp_path, on_resize, sizes
):
    cfg = _cfg(tmp_path, on_resize=on_resize)
    spec = prepare(cfg).spec
    for workers, (global_, micro, accum) in sizes.items():
        plan = spec.split_at(workers)
        assert (plan.global_batch_size, plan.micro_batch_size, plan.grad_accum_steps) == (
            global_,
            micro,
            accum,
        )
        assert plan == split_at(cfg, workers)
        # linear scaling from base batch 16
        assert spec.lr_at(workers) == pytest.approx(0.1 * global_ / 16)
        assert spec.lr_at(workers) == run_effective_lr(cfg, plan)
    assert spec.reference == cfg.batch_split() and spec.effective_lr == spec.lr_at(4)
    layout = epoch_layout(RunLength.of(cfg), spec.order.num_train_rows, spec.reference)
    assert spec.layout == layout
    assert spec.total_steps == total_optimizer_steps(RunLength.of(cfg), layout)
    assert spec.schedule_length == schedule_length(RunLength.of(cfg), layout)
    assert spec.identity == run_identity(cfg, spec.info)
    with pytest.raises(BatchSplitError, match="outside the run's sizes"):
        spec.split_at(5)


def test_a_size_that_does_not_divide_the_global_batch_keeps_it_in_uneven_shares(tmp_path):
    # 40 rows a step: 3 workers share them 14 + 13 + 13, each in 3 micro-steps of at most 5
    spec = prepare(_cfg(tmp_path, global_batch_size=40, micro_batch_size=5)).spec
    assert spec.split_at(4).grad_accum_steps == 2 and spec.split_at(4).shares == ()
    three = spec.split_at(3)
    assert three.rank_shares == (14, 13, 13) and three.grad_accum_steps == 3
    assert spec.lr_at(3) == spec.lr_at(4) == spec.lr_at(1)
    layout = spec.layout_at(three)
    windows = [layout.rank_window(0, r).micro_batches for r in range(3)]
    assert [[len(m) for m in w] for w in windows] == [[5, 5, 4], [5, 4, 4], [5, 4, 4]]
    assert np.array_equal(np.concatenate([np.concatenate(w) for w in windows]), np.arange(40))


def test_the_spec_crosses_a_process_boundary_whole(tmp_path):
    spec = prepare(_cfg(tmp_path, global_batch_size=40, micro_batch_size=5)).spec
    back = pickle.loads(pickle.dumps(spec))
    assert back.cfg == spec.cfg and back.cfg.source_file == spec.cfg.source_file
    assert back.splits.keys() == spec.splits.keys()
    for workers, plan in spec.splits.items():
        assert str(back.splits[workers]) == str(plan)
    assert back.lrs == spec.lrs and back.identity == spec.identity
    assert (back.layout, back.total_steps, back.schedule_length) == (
        spec.layout,
        spec.total_steps,
        spec.schedule_length,
    )
    positions = np.arange(spec.order.num_train_rows)
    for epoch in (0, 1):
        assert np.array_equal(
            back.order.row_ids(epoch, positions), spec.order.row_ids(epoch, positions)
        )
    assert back.split_at(3).shares == (14, 13, 13)
    with pytest.raises(BatchSplitError):
        back.split_at(5)


# one instance of every error class rayacc defines, as its own code raises it
ERRORS = {
    "ConfigError": lambda c: c(
        [ConfigIssue("batch.micro_batch_size", "must divide", 7, "use 8")], "job.yaml"
    ),
    "BatchSplitError": lambda c: c("batch.global_batch_size", "not divisible", "use 48"),
    "DuplicateKeyError": lambda c: c([("batch", 1, 5)]),
    "PlaceError": lambda c: c(["run.storage_path='/x' is not writable. Fix: another"]),
    "DeepSpeedConfigError": lambda c: c(["ds.json sets train_batch_size=7, the job 8. Fix: drop"]),
    "TrialOutOfMemory": lambda c: c(16),
    "TrainingError": lambda c: c("rank 1 failed"),
    "SubmitError": lambda c: c("no address"),
    "CheckpointError": lambda c: c("meta.json unreadable"),
    "NotAFile": lambda c: c("/runs/r/checkpoint_step00000003/state.pt", "link"),
    "UploadError": lambda c: c("rank 1's part of the checkpoint of step 3 could not be put"),
    "NoCheckpointLoads": lambda c: c("no checkpoint of run /runs/r loads: step 4 (KeyError)"),
    "LeaseLost": lambda c: c("run 'r''s lease is no longer this run's driver's"),
    "ResourceError": lambda c: c("3 workers need 3 CPUs"),
    "MicroStepMismatchError": lambda c: c("rank 0 ran 3, rank 1 ran 4"),
    "ShardError": lambda c: c("shard missing"),
    "_Refused": lambda c: c("posix.system is not part of a checkpoint index"),
    "ModelError": lambda c: c("no such factory"),
    "DataError": lambda c: c("no rows"),
    "EmptyAnswer": lambda c: c("messages[1]: an empty assistant turn"),
    "ReportError": lambda c: c("no such run"),
    "SpecError": lambda c: c("bad spec"),
    "NothingFits": lambda c: c("no candidate fits the memory budget"),
    "StrategyLoadError": lambda c: c("train.strategy 'x': its wing m:X does not load"),
}


def _rayacc_error_classes() -> dict[str, type]:
    found = {}
    for mod in pkgutil.walk_packages(rayacc.__path__, "rayacc."):
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, Exception)
                and obj.__module__ == module.__name__
            ):
                found[name] = obj
    return found


def test_every_error_rayacc_defines_survives_pickling_with_its_parts():
    classes = _rayacc_error_classes()
    # a new error class comes with its row here
    assert set(classes) == set(ERRORS), set(classes) ^ set(ERRORS)
    for name, make in ERRORS.items():
        error = make(classes[name])
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error), name
        assert {k: str(v) for k, v in vars(back).items()} == {
            k: str(v) for k, v in vars(error).items()
        }, name


def test_a_config_error_keeps_its_fields_across_processes():
    error = ERRORS["ConfigError"](ConfigError)
    back = pickle.loads(pickle.dumps(error))
    assert back.paths == ["batch.micro_batch_size"] and back.source == "job.yaml"
