"""Every committed cluster spec and job spec is valid as written, and each check catches the
mistake it exists for (each mutation below breaks one thing on purpose)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from rayacc.cluster.kuberay_spec import check_kuberay
from rayacc.cluster.launcher_spec import check_launcher
from rayacc.cluster.spec_files import SpecError, load_yaml
from rayacc.config import SweepConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[3]
LAUNCHERS = [ROOT / "cluster" / "aws.yaml", ROOT / "cluster" / "gcp.yaml"]
KUBERAY = [
    ROOT / "cluster" / "kuberay" / "raycluster.yaml",
    ROOT / "cluster" / "kuberay" / "rayjob.yaml",
    ROOT / "cluster" / "kuberay" / "networkpolicy.yaml",
]


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_launcher_specs_are_valid(path):
    check_launcher(load_yaml(path))


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_kuberay_manifests_are_valid(path):
    check_kuberay(load_yaml(path))


def mutate(doc, fn):
    doc = copy.deepcopy(doc)
    fn(doc)
    return doc


LAUNCHER_BREAKS = {
    "head type not among node types": (
        lambda c: c.update(head_node_type="head.gpu"),
        "head_node_type",
    ),
    "max_workers below sum of min_workers": (
        lambda c: (
            c.update(max_workers=1),
            c["available_node_types"]["worker.gpu"].update(min_workers=2),
        ),
        "sum of min_workers",
    ),
    "unknown top-level key": (lambda c: c.update(max_worker=3), "Additional properties"),
    "fractional resource": (
        lambda c: c["available_node_types"]["worker.gpu"].update(resources={"GPU": 0.5}),
        "is not of type 'integer'",
    ),
    "unpinned or ray-ml image": (
        lambda c: c["docker"].update(image="rayproject/ray-ml:latest-gpu"),
        "docker.image",
    ),
    "dashboard open to the world": (
        lambda c: c["head_start_ray_commands"].append("ray start --head --dashboard-host=0.0.0.0"),
        "0.0.0.0",
    ),
    "node type without node_config": (
        lambda c: c["available_node_types"]["worker.cpu"].pop("node_config"),
        "'node_config' is a required property",
    ),
}


@pytest.mark.parametrize("name", list(LAUNCHER_BREAKS))
def test_launcher_check_catches(name):
    fn, message = LAUNCHER_BREAKS[name]
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        check_launcher(mutate(load_yaml(LAUNCHERS[0]), fn))


def _aws_spot(c):
    return c["available_node_types"]["worker.gpu.spot"]["node_config"]["InstanceMarketOptions"]


def _gcp_spot(c):
    return c["available_node_types"]["worker.gpu.spot"]["node_config"]["scheduling"]


def _no_spot_agent(c):
    c["worker_start_ray_commands"] = [
        cmd for cmd in c["worker_start_ray_commands"] if "rayacc.cluster.spot" not in cmd
    ]


SPOT_BREAKS = {
    "aws: a reclaimed node stopped": (
        "aws.yaml",
        lambda c: _aws_spot(c)["SpotOptions"].update(InstanceInterruptionBehavior="stop"),
        "InstanceInterruptionBehavior: use terminate",
    ),
    "aws: a persistent spot request": (
        "aws.yaml",
        lambda c: _aws_spot(c)["SpotOptions"].update(SpotInstanceType="persistent"),
        "SpotInstanceType: use one-time",
    ),
    "aws: market options not spot": (
        "aws.yaml",
        lambda c: _aws_spot(c).update(MarketType="capacity-block"),
        "MarketType: use spot",
    ),
    "aws: no reclaim agent": ("aws.yaml", _no_spot_agent, "rayacc.cluster.spot --cloud aws"),
    "gcp: no reclaim agent": ("gcp.yaml", _no_spot_agent, "rayacc.cluster.spot --cloud gcp"),
    "gcp: scheduling as a list": (
        "gcp.yaml",
        lambda c: c["available_node_types"]["worker.gpu"]["node_config"].update(
            scheduling=[{"onHostMaintenance": "TERMINATE"}]
        ),
        "takes one object",
    ),
    "gcp: spot restarting": (
        "gcp.yaml",
        lambda c: _gcp_spot(c).update(automaticRestart=True),
        "automaticRestart: must be false",
    ),
    "gcp: spot kept stopped": (
        "gcp.yaml",
        lambda c: _gcp_spot(c).update(instanceTerminationAction="STOP"),
        "instanceTerminationAction: use DELETE",
    ),
    "gcp: the older preemptible VMs": (
        "gcp.yaml",
        lambda c: c["available_node_types"]["worker.gpu.spot"]["node_config"].update(
            scheduling={"preemptible": True, "automaticRestart": False}
        ),
        "use provisioningModel: SPOT",
    ),
    "gcp: GPUs not declared": (
        "gcp.yaml",
        lambda c: c["available_node_types"]["worker.gpu"].update(resources={}),
        "declare CPU and GPU: 1",
    ),
}


def _spot_group(d):
    return d["spec"]["workerGroupSpecs"][1]["template"]["spec"]


def _spot_container(d):
    return _spot_group(d)["containers"][0]


SPOT_GROUP_BREAKS = {
    "spot taint not tolerated": (
        lambda d: _spot_group(d)["tolerations"].pop(0),
        "toleration for the spot taint cloud.google.com/gke-spot",
    ),
    "no preStop drain": (
        lambda d: _spot_container(d).pop("lifecycle"),
        "needs a preStop hook",
    ),
    "drain without a deadline": (
        lambda d: _spot_container(d)["lifecycle"]["preStop"]["exec"].update(
            command=["ray", "drain-node", "--reason=DRAIN_NODE_REASON_PREEMPTION"]
        ),
        "gives no --deadline-remaining-seconds",
    ),
    "grace period shorter than the deadline": (
        lambda d: _spot_group(d).update(terminationGracePeriodSeconds=10),
        "terminationGracePeriodSeconds 10 must exceed",
    ),
}


@pytest.mark.parametrize("name", list(SPOT_GROUP_BREAKS))
def test_kuberay_spot_group_is_checked(name):
    fn, message = SPOT_GROUP_BREAKS[name]
    with pytest.raises(SpecError, match=message):
        check_kuberay(mutate(load_yaml(KUBERAY[0]), fn))


@pytest.mark.parametrize("name", list(SPOT_BREAKS))
def test_spot_node_types_are_checked(name):
    spec, fn, message = SPOT_BREAKS[name]
    with pytest.raises(SpecError, match=message):
        check_launcher(mutate(load_yaml(ROOT / "cluster" / spec), fn))


def _worker_group(d):
    return d["spec"]["workerGroupSpecs"][0]


KUBERAY_BREAKS = {
    "rayStartParams value not a string": (
        lambda d: _worker_group(d)["rayStartParams"].update({"num-gpus": 1}),
        "is not of type 'string'",
    ),
    "unknown field": (
        lambda d: d["spec"].update(enableInTreeAutoscaler=True),
        "Additional properties",
    ),
    "replicas not explicit": (
        lambda d: _worker_group(d).pop("minReplicas"),
        "'minReplicas' is a required",
    ),
    "replicas outside bounds": (lambda d: _worker_group(d).update(replicas=9), "outside"),
    "GPU limit missing": (
        lambda d: _worker_group(d)["template"]["spec"]["containers"][0]["resources"]["limits"].pop(
            "nvidia.com/gpu"
        ),
        "nvidia.com/gpu=None",
    ),
    "another Ray version": (lambda d: d["spec"].update(rayVersion="2.9.0"), "rayVersion"),
    "dashboard on loopback": (
        lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].update(
            {"dashboard-host": "127.0.0.1"}
        ),
        "dashboard-host: must be",
    ),
    "head exposed outside": (
        lambda d: d["spec"]["headGroupSpec"].update(serviceType="LoadBalancer"),
        "LoadBalancer exposes the head",
    ),
}


NETWORKPOLICY_BREAKS = {
    "open to other namespaces": (
        lambda d: d["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}}),
        "dashboard port only",
    ),
    "open to every address": (
        lambda d: d["spec"]["ingress"][0].pop("from"),
        "only podSelector peers",
    ),
    "not the head": (
        lambda d: d["spec"]["podSelector"]["matchLabels"].pop("ray.io/node-type"),
        "must select the head",
    ),
    "operator shut out": (
        lambda d: d["spec"]["ingress"].pop(1),
        "no rule admits the KubeRay operator",
    ),
    "operator on every port": (
        lambda d: d["spec"]["ingress"][1].pop("ports"),
        "dashboard port only",
    ),
    "operator on another port": (
        lambda d: d["spec"]["ingress"][1]["ports"][0].update(port=6379),
        "dashboard port only",
    ),
    "every namespace by IP": (
        lambda d: d["spec"]["ingress"][1]["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}}),
        "only podSelector peers",
    ),
}


@pytest.mark.parametrize("name", list(NETWORKPOLICY_BREAKS))
def test_networkpolicy_check_catches(name):
    fn, message = NETWORKPOLICY_BREAKS[name]
    with pytest.raises(SpecError, match=message):
        check_kuberay(mutate(load_yaml(KUBERAY[2]), fn))


@pytest.mark.parametrize("name", list(KUBERAY_BREAKS))
def test_kuberay_check_catches(name):
    fn, message = KUBERAY_BREAKS[name]
    with pytest.raises(SpecError, match=message):
        check_kuberay(mutate(load_yaml(KUBERAY[0]), fn))


def test_rayjob_check_catches_unknown_field():
    with pytest.raises(SpecError, match="Additional properties"):
        check_kuberay(mutate(load_yaml(KUBERAY[1]), lambda d: d["spec"].update(entrypointz="x")))


JOBS = sorted((ROOT / "jobs").glob("*.yaml"))


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_every_job_spec_loads(path):
    raw = load_yaml(path)
    if "grid" in raw or "base" in raw:
        sweep, base, _ = SweepConfig.from_yaml(path)
        assert TrainConfig.model_validate(base).batch_split().global_batch_size > 0
        assert sweep.grid or sweep.random.samples
    else:
        cfg = TrainConfig.from_yaml(path)
        assert cfg.batch_split().global_batch_size > 0


def test_rayjob_runs_a_job_spec_from_jobs():
    entry = load_yaml(KUBERAY[1])["spec"]["entrypoint"]
    spec = entry.split("-c ")[1].split()[0]
    assert spec.startswith("/home/ray/rayacc/jobs/")
    assert (ROOT / "jobs" / Path(spec).name).is_file()


def test_every_image_and_node_installs_rayacc_with_the_extras_a_job_may_use():
    """A job's `model.name: hf` or `train.strategy: deepspeed` needs its extra on every node: a
    spec or an image that installs rayacc installs every extra pyproject declares but dev."""
    import re
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]) - {"dev"}  # fmt: skip
    installs = [
        (path.relative_to(ROOT), line)
        for path in sorted((ROOT / "cluster").rglob("*"))
        if path.is_file() and path.suffix in ("", ".yaml", ".yml", ".sh") and path.stat().st_size
        for line in path.read_text(errors="replace").splitlines()
        if re.search(r"pip install .*-e \S*/home/ray/rayacc", line)
    ]
    assert len(installs) >= 3, installs  # the two launcher specs and the KubeRay image
    for where, line in installs:
        found = re.search(r"rayacc\[([a-z,]+)\]", line)
        assert found and set(found.group(1).split(",")) == extras, f"{where}: {line.strip()}"
