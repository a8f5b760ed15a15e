"""The strategy object (engine/parallel/) on 2 gloo ranks: a micro-batch search leaves the
model exactly as it found it, for every strategy and sync mode; a user model's buffers survive
FSDP's materialisation on the meta device."""

from __future__ import annotations

import pytest
import torch

from tests.support.ranks import strategy_workers as W
from tests.support.ranks.engine_helpers import spawn_ranks, update_rel_err

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = spawn_ranks(W.run_rank, 2, tmp_path_factory.mktemp("strategy"), "strategy scenarios")
    assert "error" not in out[0], out[0].get("error")
    return out


@pytest.mark.parametrize("strategy", W.STRATEGIES)
def test_a_micro_batch_search_leaves_the_first_step_bit_for_bit(ranks, strategy):
    """The search's trials run forward and backward (with dropout) without syncing; after it
    no gradient is left anywhere (FSDP's unsharded ones included), sync is on, the random state
    is as before, and the first step equals the step of a model that was never searched."""
    plain, searched = ranks[0][strategy][False], ranks[0][strategy][True]
    assert len(searched["trials"]) >= 2, searched["trials"]
    assert searched["rng_kept"]
    assert searched["param_grads"] == 0 and searched["internal_grads"] == 0
    assert searched["sync_on"]
    assert searched["comm"] == plain["comm"]
    assert searched["grad_norm"] == plain["grad_norm"]
    assert torch.equal(searched["params"], plain["params"])


def test_a_buffer_of_a_model_built_on_the_meta_device_keeps_its_value(ranks):
    """FSDP builds a model that says how its parameters start on the meta device and fills
    only each rank's shards; the buffer its own code computed (a causal averaging mask) stays,
    and one step equals the single-process full-batch step."""
    from rayacc.models import build_model

    got = ranks[0]["buffer"]
    cfg = W.gpt_config("ddp", dropout=0.0, factory=f"{W.__name__}:masked_lm")
    model = build_model(cfg, W.dataset())
    assert torch.equal(got["mix"], model.mix)
    before = W.full_weights(model)
    assert torch.equal(got["before"], before), "the materialised weights are build_model's"
    from rayacc.engine import IGNORE_INDEX, collate_tokens

    batch = collate_tokens(W.window(0) + W.window(1))
    logits = model(batch["input"])
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, W.VOCAB), batch["target"].reshape(-1), ignore_index=IGNORE_INDEX
    )
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    assert update_rel_err(before, got["after"], W.full_weights(model)) <= 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "fsdp every_micro_step"])
def test_training_from_hf_weights_starts_from_exactly_those_weights(ranks, strategy):
    """`model.hf.weights` (a save_pretrained folder, as `rayacc export` writes an hf model):
    the first step's loss over both ranks' rows is transformers' own forward loss on them."""
    for rank in (0, 1):
        got = ranks[rank]["hf_weights"][strategy]
        assert abs(got["loss"] - got["transformers"]) <= 1e-5 * got["transformers"], got
