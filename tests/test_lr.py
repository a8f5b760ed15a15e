import itertools
import math

import pytest
import torch

from rayacc.engine import build_scheduler, effective_lr, lr_multiplier


@pytest.mark.parametrize(
    ("rule", "expected"),
    [("linear", 0.4), ("sqrt", 0.1 * math.sqrt(4)), ("none", 0.1)],
)
def test_rules_scale_up(rule, expected):
    assert effective_lr(0.1, 1024, 256, rule) == pytest.approx(expected)


def test_rules_scale_down():
    assert effective_lr(0.1, 64, 256, "linear") == pytest.approx(0.025)
    assert effective_lr(0.1, 64, 256, "sqrt") == pytest.approx(0.05)


def test_without_base_batch_the_lr_is_kept():
    assert effective_lr(3e-4, 512, None, "linear") == 3e-4


def test_unknown_rule_names_the_field():
    with pytest.raises(ValueError, match="optim.lr_scaling='cube'"):
        effective_lr(0.1, 8, 8, "cube")


def test_warmup_is_linear_to_one():
    mults = [lr_multiplier(s, warmup_steps=4, total_steps=None) for s in range(6)]
    assert mults == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_cosine_reaches_min_ratio_at_last_step():
    kw = dict(warmup_steps=2, total_steps=12, schedule="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(1, **kw) == pytest.approx(1.0)
    assert lr_multiplier(2, **kw) == pytest.approx(1.0)
    assert lr_multiplier(11, **kw) == pytest.approx(0.1)
    mid = lr_multiplier(2 + 9 / 2, **kw)
    assert mid == pytest.approx(0.1 + 0.9 * 0.5)
    series = [lr_multiplier(s, **kw) for s in range(2, 12)]
    assert all(a > b for a, b in itertools.pairwise(series))


def test_constant_schedule():
    assert [
        lr_multiplier(s, warmup_steps=0, total_steps=10, schedule="constant") for s in (0, 5, 9)
    ] == [1, 1, 1]


def test_unknown_schedule():
    with pytest.raises(ValueError, match="optim.schedule"):
        lr_multiplier(3, warmup_steps=0, total_steps=10, schedule="step")


def test_scheduler_drives_the_optimizer_per_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.2)
    sched = build_scheduler(opt, warmup_steps=2, total_steps=4, schedule="cosine", min_lr_ratio=0.0)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.2, 0.2, 0.0])
