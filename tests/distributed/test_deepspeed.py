"""DeepSpeed ZeRO as a strategy (engine/parallel/deepspeed.py) on 2 gloo ranks: one optimizer
step over micro × accumulation × workers equals the single-process full-batch step at every
stage, with and without optimizer offload, for a full window and a short last one; and the
user's DeepSpeed config is merged under the job's keys or refused naming both values."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.ranks import deepspeed_workers as W
from tests.support.ranks.engine_helpers import (
    classification_rows,
    full_batch_classification_loss,
    reference_sgd_step,
    slice_rows,
    spawn_ranks,
    update_rel_err,
)

pytestmark = pytest.mark.distributed
deepspeed = pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("deepspeed")
    out = spawn_ranks(W.run_rank, 2, out_dir, "DeepSpeed cases")
    for r in out:
        assert "error" not in r, r.get("error")
        r["out_dir"] = out_dir
    return out


def reference(stage: int, offload: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The same model's weights before and after the same two steps in one process, each on
    its window's whole rows."""
    from rayacc.models import build_model

    model = build_model(W.config(stage, offload), W.dataset())
    before = torch.cat([p.detach().reshape(-1).double().clone() for p in model.parameters()])
    rows = classification_rows(28, seed=9)
    for lo, hi, _ in W.WINDOWS:
        loss = full_batch_classification_loss(model, slice_rows(rows, lo, hi))
        reference_sgd_step(model, loss, W.LR)
    after = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    return before, after


@pytest.mark.parametrize("stage", [2, 3])
def test_uneven_shares_under_zero_equal_the_full_batch_steps(ranks, stage, record_equivalence):
    # an elastic size that does not divide the global batch: 13 + 12 rows, three micro-steps
    # of at most 6 on both ranks (DeepSpeed's accumulation boundary where rayacc's window ends)
    from tests.support.ranks import uneven as U

    got = [r[("uneven", stage)] for r in ranks]
    assert [g["shares"] for g in got] == [(13, 12)] * 2
    assert [[s[2] for s in g["steps"]] for g in got] == [[[5, 4, 4], [2]], [[4, 4, 4], [1]]]
    assert [s[:2] for s in got[0]["steps"]] == [(25, 3), (3, 1)]
    before, after = U.reference(2)
    assert torch.equal(got[0]["before"], before)
    err = update_rel_err(before, got[0]["after"], after)
    record_equivalence(f"uneven shares 13+12 on 2 ranks, ZeRO-{stage}", err)
    assert err <= 1e-5, err


@pytest.mark.parametrize(
    "stage, offload", W.CASES, ids=[f"zero{s}-offload_{o}" for s, o in W.CASES]
)
def test_each_stage_equals_the_full_batch_steps(ranks, stage, offload, record_equivalence):
    got = ranks[0][(stage, offload)]
    before, after = reference(stage, offload)
    assert torch.equal(got["before"], before), "the engine starts from build_model's weights"
    assert torch.equal(ranks[1][(stage, offload)]["after"], got["after"])
    # a full window of 2 micro-steps per rank, then a short one of 4 rows
    assert got["steps"] == [(24, False, 2), (4, False, 1)]
    assert got["lockstep"] == (stage == 3)
    # DeepSpeed's collectives per window (all-reduce, reduce-scatter, all-gather, backward
    # passes that reduced), measured under the caller's window: ZeRO-1 all-reduces the
    # gradients once, in the step; ZeRO-2 in every backward; ZeRO-3 reduce-scatters in every
    # backward and gathers parameters; each also all-reduces the gradient norm once
    for (_, _, micro), (allreduce, reduce_scatter, all_gather, passes) in zip(
        got["steps"], got["comm"], strict=True
    ):
        if stage == 1:
            assert (allreduce, reduce_scatter, passes) == (2, 0, 1), got["comm"]
        elif stage == 2:
            assert (allreduce, reduce_scatter, passes) == (micro + 1, 0, micro), got["comm"]
        else:
            assert (allreduce, reduce_scatter, passes) == (1, micro, micro), got["comm"]
        assert all_gather >= 1, got["comm"]
    err = update_rel_err(before, got["after"], after)
    record_equivalence(f"deepspeed zero{stage} offload {offload}", err)
    assert err <= 1e-5, err


BF16_BOUND = 3 * math.sqrt(12) * 2.0**-8
"""tests/distributed/test_matrix.py's bound for the MLP's 2 linear layers: 6 bf16 roundings
each, errors of independent sign, three standard deviations (a wrong normalisation is ≥ 0.3)."""


@pytest.mark.parametrize(
    "stage, offload", W.BF16_CASES, ids=[f"zero{s}-offload_{o}" for s, o in W.BF16_CASES]
)
def test_each_stage_in_bf16_is_the_full_batch_steps_within_bf16_rounding(
    ranks, stage, offload, record_equivalence
):
    """DeepSpeed's bf16 (the module in bf16, the optimizer's fp32 master weights, which the
    checkpoint holds): the two steps' update within bf16's rounding of the fp32 full-batch
    steps."""
    from rayacc.engine.parallel.deepspeed_files import read_zero_weights
    from rayacc.models import build_model

    got = ranks[0][(stage, offload, "bf16")]
    assert got["steps"] == [(24, False, 2), (4, False, 1)]
    before, after = reference(stage, offload)
    names = [n for n, _ in build_model(W.config(stage, offload), W.dataset()).named_parameters()]
    weights = read_zero_weights(ranks[0]["out_dir"] / f"zero{stage}-{offload}-bf16" / "zero", 2)
    trained = torch.cat([weights[n].reshape(-1).double() for n in names])
    err = update_rel_err(before, trained, after)
    record_equivalence(f"deepspeed zero{stage} offload {offload} bf16", err)
    assert err <= BF16_BOUND, err


def test_zero3_training_from_hf_weights_starts_from_exactly_those_weights(ranks):
    """`model.hf.weights` under ZeRO-3 (parameters partitioned as DeepSpeed builds them): the
    first step's loss over both ranks' rows is transformers' own forward loss on them."""
    for rank in (0, 1):
        got = ranks[rank]["hf_weights"]
        assert abs(got["loss"] - got["transformers"]) <= 1e-5 * got["transformers"], got


@pytest.mark.parametrize(
    "stage, offload", W.CASES, ids=[f"zero{s}-offload_{o}" for s, o in W.CASES]
)
def test_the_weights_read_back_from_deepspeeds_files_without_its_runtime(
    ranks, tmp_path_factory, stage, offload
):
    """The checkpoint every rank wrote through DeepSpeed, read whole in this process
    (read_zero_weights: DeepSpeed's files as data, its partitions put back together), holds
    exactly the weights the ranks trained."""
    import sys

    from rayacc.engine.parallel.deepspeed_files import read_zero_weights
    from rayacc.models import build_model

    folder = ranks[0]["out_dir"] / f"zero{stage}-{offload}" / "zero"
    names = [n for n, _ in build_model(W.config(stage, offload), W.dataset()).named_parameters()]
    modules = set(sys.modules)
    weights = read_zero_weights(folder, 2)
    assert not {m for m in set(sys.modules) - modules if m.startswith("deepspeed")}
    read = torch.cat([weights[n].reshape(-1).double() for n in names])
    assert torch.equal(read, ranks[0][(stage, offload)]["after"])


@pytest.mark.parametrize("world", [1, 2])
def test_zero3_resumes_at_the_same_or_another_number_of_ranks(ranks, tmp_path, world):
    """2 ranks take a window under ZeRO-3 and AdamW, save, and take the short last window;
    `world` ranks resume their checkpoint (at 2, DeepSpeed's own load; at 1, its universal
    checkpoint: the weights and AdamW's moments resharded) and take the same window: the same
    weights."""
    folder = tmp_path / "resumed"
    folder.mkdir()
    shutil.copytree(ranks[0]["out_dir"] / "adamw", folder / "adamw")
    resumed = spawn_ranks(W.resize_rank, world, folder, "resumed DeepSpeed ranks")
    want = ranks[0]["adamw"]
    assert torch.equal(ranks[1]["adamw"], want)
    for r in resumed:
        assert "error" not in r, r.get("error")
        err = float((r["adamw"] - want).norm() / want.norm())
        assert err <= 1e-6, err


def test_a_resume_refuses_a_deepspeed_file_that_would_run_code(ranks):
    """DeepSpeed's loader unpickles its files whole: a rank's optimizer file replaced by a
    pickle that runs a command is refused by every rank before DeepSpeed reads it, naming the
    file, and the command never runs."""
    for r in ranks:
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in r["planted"], r["planted"]
        assert "could run code" in r["planted"], r["planted"]
    assert not (ranks[0]["out_dir"] / "payload-ran").exists()


def _damaged(path: Path, how: str, rng: random.Random, marker: Path) -> None:
    data = path.read_bytes()
    if how == "flip":
        buf = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(buf))
    elif how == "truncate":
        path.write_bytes(data[: rng.randrange(len(data))])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "code":
        torch.save({"module": {}, "optimizer_state_dict": W.Payload(str(marker))}, path)
    elif how == "other shape":
        torch.save(rng.choice([[1, 2], {"module": 3}, {"optimizer_state_dict": {"x": 1}}]), path)
    elif how == "missing":
        path.unlink()


@pytest.mark.parametrize("stage", [1, 3])
def test_damaged_deepspeed_files_are_refused_naming_them_and_run_no_code(ranks, tmp_path, stage):
    """Seeded damage to one file of a real DeepSpeed checkpoint (bytes flipped, cut short,
    emptied, a pickle that runs code, another structure, a rank's file gone): the reader of
    DeepSpeed's files (the one resume vets them with, and load_model's) raises ValueError
    naming a file or the folder, or reads weights of the right shapes; never another exception,
    never the payload run."""
    from rayacc.engine.parallel.deepspeed_files import read_zero_weights, vet_zero_files

    original = ranks[0]["out_dir"] / f"zero{stage}-none" / "zero"
    shapes = {k: v.shape for k, v in read_zero_weights(original, 2).items()}
    outcomes: dict[str, int] = {}
    for seed in range(40):
        rng = random.Random(f"{stage}-{seed}")
        folder = tmp_path / f"case{seed}"
        shutil.copytree(original, folder)
        target = rng.choice(sorted(folder.iterdir()))
        how = rng.choice(["flip", "truncate", "empty", "code", "other shape", "missing"])
        marker = tmp_path / f"ran{seed}"
        _damaged(target, how, rng, marker)
        for read in (vet_zero_files, read_zero_weights):
            try:
                value = read(folder, 2)
            except ValueError as exc:
                assert target.name in str(exc) or str(folder) in str(exc), (how, exc)
                outcomes[f"{how}: refused"] = outcomes.get(f"{how}: refused", 0) + 1
                continue
            if read is read_zero_weights:
                assert {k: v.shape for k, v in value.items()} == shapes, how
            outcomes[f"{how}: read"] = outcomes.get(f"{how}: read", 0) + 1
        assert not marker.exists(), f"case {seed}: the payload ran"
    for how in ("truncate", "empty", "code", "missing"):
        assert outcomes.get(f"{how}: refused"), outcomes


def test_no_compiler_for_deepspeeds_op_is_said_with_the_fix(tmp_path):
    """DeepSpeed builds a small op at its first start on a machine: where no C++ compiler runs,
    the error says what failed, where the build is cached and how to fix it."""
    (one,) = spawn_ranks(W.no_compiler_rank, 1, tmp_path, "DeepSpeed rank without a compiler")
    raised = one["raised"] or ""
    assert raised.startswith("RuntimeError: DeepSpeed builds a small op"), raised
    assert "Fix: install g++ and ninja" in raised and str(tmp_path) in raised, raised


def _rayacc_checkpoint(ranks, stage: int, offload: str, folder: Path) -> Path:
    """The case's DeepSpeed files in a rayacc checkpoint folder, rank 0's manifest listing
    them all (as every rank's parts together do)."""
    from rayacc.checkpoint import write_checkpoint

    shutil.copytree(ranks[0]["out_dir"] / f"zero{stage}-{offload}" / "zero", folder / "zero")
    cfg = W.config(stage, offload)
    return write_checkpoint(
        folder,
        state={"train_state": {}},
        description={"config": cfg.model_dump(mode="json"), "dataset": W.dataset().to_dict()},
        meta={
            "optimizer_step": 2,
            "num_workers": 2,
            "shards": "zero",
            "state_format": "deepspeed",
            "parts": [],
        },
    )


@pytest.mark.parametrize("stage, offload", [c for c in W.CASES if c[1] == "none"])
def test_deepspeeds_readers_see_only_the_manifests_files_of_the_ranks_it_names(
    ranks, tmp_path, stage, offload
):
    """Every ZeRO stage's checkpoint: a file no manifest lists, named as DeepSpeed's loader
    and converter match names (read from its own constants), in the checkpoint or its `zero/`
    folder, is refused by the reader naming it; crafted into the manifest, one in `zero/` is
    still refused before DeepSpeed could read it (its names are the written world size's, from
    meta.json); the files of another world size are strangers, not one more rank. Nothing is
    unpickled."""
    from rayacc.checkpoint import CheckpointError, load_model, read_checkpoint
    from rayacc.checkpoint.format import META_FILE, file_entry
    from rayacc.engine.parallel.deepspeed_files import read_zero_weights
    from tests.support.data.strangers import foreign_names, plant

    original = _rayacc_checkpoint(ranks, stage, offload, tmp_path / "original")
    want = read_zero_weights(original / "zero", 2)
    loaded = load_model(original).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in want.items())
    for i, name in enumerate(foreign_names(world=2)):
        for inside in ("", "zero"):
            folder = tmp_path / f"case{i}{inside}"
            shutil.copytree(original, folder)
            marker = tmp_path / f"ran{i}{inside}"
            stranger = plant(folder / inside, name, marker)
            relative = stranger.relative_to(folder).as_posix()
            with pytest.raises(CheckpointError, match="not listed by any manifest") as refused:
                read_checkpoint(folder)
            assert relative in str(refused.value)
            meta = json.loads((folder / META_FILE).read_text())
            meta["files"][relative] = file_entry(stranger)  # crafted to match
            (folder / META_FILE).write_text(json.dumps(meta))
            if inside:
                with pytest.raises(CheckpointError, match="not a file DeepSpeed writes"):
                    load_model(folder)
            else:
                assert load_model(folder) is not None
            assert not marker.exists(), f"{relative} was unpickled"
            shutil.rmtree(folder)
    # 2 ranks' files under a meta.json that says 1 wrote them: leftovers of another world size
    meta = json.loads((original / META_FILE).read_text())
    (original / META_FILE).write_text(json.dumps({**meta, "num_workers": 1}))
    with pytest.raises(CheckpointError, match="not a file DeepSpeed writes for a checkpoint of 1"):
        read_checkpoint(original)
