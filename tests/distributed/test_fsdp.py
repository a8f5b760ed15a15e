"""FSDP2 + accumulation over 2 gloo processes equals the single-process full-batch steps, in
both gradient-sync modes, and each mode does the reduce-scatters it says."""

from __future__ import annotations

import pytest
import torch

from tests.support.ranks import fsdp_workers as F
from tests.support.ranks.engine_helpers import params_vector, spawn_ranks, update_rel_err

pytestmark = pytest.mark.distributed
WORLD = 2
MODES = ("every_micro_step", "window_end")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(F.run_rank, WORLD, tmp_path_factory.mktemp("fsdp"), "2-process FSDP run")


def full_batch_loss(model: torch.nn.Module, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Mean over every target token of the window (padding excluded), in one process."""
    from rayacc.engine import IGNORE_INDEX, collate_tokens

    batch = collate_tokens(seqs)
    logits = model(batch["input"])
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, F.VOCAB), batch["target"].reshape(-1), ignore_index=IGNORE_INDEX
    )


def reference() -> tuple[torch.Tensor, torch.Tensor]:
    """(initial, final) weights of the same three AdamW steps with clipping, each on a whole
    window's sequences in one process."""
    model = F.gpt()
    before = params_vector(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    for window in F.windows():
        opt.zero_grad()
        full_batch_loss(model, window).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return before, params_vector(model)


@pytest.mark.parametrize("mode", MODES)
def test_fsdp_accumulation_equals_full_batch(ranks, record_equivalence, mode):
    assert "error" not in ranks[0], ranks[0].get("error")
    before, after = reference()
    got = ranks[0][mode]["params"]
    assert torch.equal(got, ranks[1][mode]["params"])
    err = update_rel_err(before, got, after)
    ddp = update_rel_err(before, ranks[0]["ddp"]["params"], after)
    record_equivalence(
        f"FSDP2 {mode}, 2 ranks, GPT, padded tokens, AdamW, clipping, short last window "
        f"(DDP on the same: {ddp:.2e})",
        err,
    )
    # three Adam steps on a GPT in float32: rounding alone moves the update by ~1e-5 (DDP on
    # the same windows is the yardstick); a wrong normalisation or a missed sync is >1e-2
    assert err <= max(2 * ddp, 1e-6) and err <= 5e-5, (err, ddp)
    last = ranks[0][mode]["results"][-1]
    assert last.samples == F.WINDOWS[-1] and last.micro_steps == 3


def test_each_sync_mode_reduce_scatters_as_it_says(ranks):
    """3 FSDP units (2 blocks + the root): a reduce-scatter per unit and micro-step, or per
    unit and window."""
    every = [r.reduce_scatter_calls for r in ranks[0]["every_micro_step"]["results"]]
    end = [r.reduce_scatter_calls for r in ranks[0]["window_end"]["results"]]
    assert every == [4 * 3, 4 * 3, 3 * 3]
    assert end == [3, 3, 3]
    # timed too (comm/sync_time_frac): from the first reduce-scatter launched to the last done
    for mode in MODES:
        assert all(r.sync_time_s > 0 for r in ranks[0][mode]["results"]), mode


def test_auto_micro_batch_search_runs_in_lockstep_on_a_sharded_model(ranks):
    """Every trial of a sharded model is agreed by all ranks: both try 2 then 4 and choose 2
    (without the agreement rank 0 would run an 8 alone and wait forever in its all-gather)."""
    assert "error" not in ranks[0], ranks[0].get("error")
    used = ranks[0]["search"]["used"]
    assert used[2] < used[4] < used[8]
    for r in ranks:
        found = r["search"]["found"]
        assert (found.micro_batch_size, found.grad_accum_steps) == (2, 4)
        assert found.trials == [(2, True), (4, False)]
    assert ranks[0]["search"]["found"].local_choice == 2


def test_ranks_materialise_only_their_shards_of_the_same_initial_weights(tmp_path):
    """A sharded run's GPT is built on the meta device (building it whole on a rank fails this
    test) and each rank fills only its shards, from the seed: at 1, 2 and 3 ranks (uneven
    chunks) the full weights are build_model's, exactly, and the ranks hold one model between
    them."""
    from rayacc.models import build_model

    cfg, info = F.seeded_config()
    expected = dict(build_model(cfg, info).named_parameters())
    total = sum(p.numel() for p in expected.values())
    for world in (1, 2, 3):
        folder = tmp_path / f"w{world}"
        folder.mkdir()
        got = spawn_ranks(F.materialise, world, folder, "sharded build")
        assert "error" not in got[0], got[0].get("error")
        assert got[0]["full"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(got[0]["full"][name], value.detach()), (world, name)
        assert sum(r["held"] for r in got) == total
        if world > 1:
            assert max(r["held"] for r in got) < total


def test_a_checkpoint_written_in_the_background_holds_the_state_it_was_taken_at(ranks):
    """train.checkpoint_mode=async: the sharded write is in flight while two more windows
    train (DCP's collectives on a group of its own); loaded after, it holds the weights of the
    step it was taken at, and DDP's copy does not follow the live parameters."""
    for rank in ranks:
        got = rank["background"]
        assert got["whole"] == {}
        assert not torch.equal(got["at_save"], got["after"]), "training went on meanwhile"
        assert torch.equal(got["loaded"], got["at_save"])
    assert ranks[0]["background"]["ddp_copy_kept"] is True
