"""A worker group the cluster can never hold is an error before launching, not a silent wait."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayacc.config import TrainConfig
from rayacc.config.mesh import Mesh
from rayacc.driver.prelaunch import ResourceError, check_resources, workers_that_fit

ROOT = Path(__file__).resolve().parents[3]
NODE = {"Alive": True, "Resources": {"CPU": 4.0, "memory": 1e10, "node:127.0.0.1": 1.0}}


def cfg(**scaling) -> TrainConfig:
    return TrainConfig.from_dict(
        {"batch": {"global_batch_size": 32, "micro_batch_size": 4}, "scaling": scaling}
    )


def test_workers_that_fit_count_per_node():
    assert workers_that_fit([{"CPU": 4.0}, {"CPU": 1.5}], {"CPU": 1.0}) == 5
    assert workers_that_fit([{"CPU": 4.0}], {"CPU": 1.0, "GPU": 1.0}) == 0
    assert workers_that_fit([{"CPU": 4.0, "slot": 1.0}] * 2, {"CPU": 1.0, "slot": 1.0}) == 2


@pytest.mark.parametrize(
    "scaling, names",
    [
        ({"num_workers": 2, "use_gpu": True}, ["GPU", "scaling.use_gpu=false"]),
        ({"num_workers": [1, 2], "extra_resources": {"worker_slot": 1}}, ["worker_slot"]),
        ({"num_workers": 8, "cpus_per_worker": 1}, ["8 worker(s)", "hold 4", "lower"]),
    ],
    ids=["gpu-on-cpu", "custom-resource", "too-many-workers"],
)
def test_a_request_no_node_can_meet_names_what_is_missing(scaling, names):
    with pytest.raises(ResourceError) as err:
        check_resources(cfg(**scaling).scaling, [NODE], may_grow=False)
    for name in names:
        assert name in str(err.value), str(err.value)
    # a cluster that may add nodes: the same finding as a warning
    assert "GPU" in (check_resources(cfg(num_workers=1, use_gpu=True).scaling, [NODE], True) or "")


def test_a_request_that_fits_passes():
    assert check_resources(cfg(num_workers=2).scaling, [NODE], may_grow=False) is None


@pytest.mark.parametrize(
    ("placement", "nodes", "workers", "fits"),
    [
        # CPU per node; 1 CPU a worker
        ("STRICT_SPREAD", [4.0], 2, False),  # one node holds 4 workers, but one a node
        ("STRICT_SPREAD", [1.0, 1.0], 2, True),
        ("STRICT_SPREAD", [4.0, 0.5], 2, False),  # the second node holds none
        ("STRICT_PACK", [1.0, 1.0], 2, False),  # 2 in all, never 2 on one node
        ("STRICT_PACK", [2.0, 1.0], 2, True),
        ("PACK", [1.0, 1.0], 2, True),
        ("SPREAD", [4.0], 2, True),  # soft: spreads when it can
        ("SPREAD", [0.5, 0.5], 2, False),
    ],
)
def test_the_placement_strategy_decides_where_workers_may_go(placement, nodes, workers, fits):
    config = cfg(num_workers=workers, cpus_per_worker=1, placement_strategy=placement)
    alive = [{"Alive": True, "Resources": {"CPU": c}} for c in nodes]
    if fits:
        assert check_resources(config.scaling, alive, may_grow=False) is None
        return
    with pytest.raises(ResourceError) as err:
        check_resources(config.scaling, alive, may_grow=False)
    assert placement in str(err.value) and "scaling.placement_strategy" in str(err.value)
    if sum(int(c) for c in nodes) >= workers:
        assert "placement_strategy=" in str(err.value), "the fix names another strategy"
    assert check_resources(config.scaling, alive, may_grow=True) is not None, (
        "a warning on a cluster that may grow"
    )


@pytest.mark.parametrize(("cpus", "fits"), [([1.0, 1.0], False), ([2.0, 1.0, 1.0], True)])
def test_a_tensor_parallel_group_no_node_holds_is_refused(cpus, fits):
    """4 workers of 1 CPU fit two nodes of 1 CPU in all, but a group of 2 on none of them."""
    config = cfg(num_workers=2, cpus_per_worker=1)
    alive = [{"Alive": True, "Resources": {"CPU": c}} for c in cpus]
    if fits:
        assert check_resources(config.scaling, alive, False, Mesh(tensor=2)) is None
        return
    with pytest.raises(ResourceError) as err:
        check_resources(config.scaling, alive, False, Mesh(tensor=2))
    text = str(err.value)
    assert "train.tensor_parallel=2" in text and "largest node holds 1" in text, text
    assert "at most 1" in text, text
    assert "largest node holds 1" in check_resources(config.scaling, alive, True, Mesh(tensor=2))
    assert check_resources(config.scaling, alive, False) is None  # without it, the group fits
