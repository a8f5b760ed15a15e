"""Ray cluster launcher specs (aws.yaml, gcp.yaml): Ray's ray-schema.json, the rules Ray
applies in code before `ray up` starts nodes, and spot capacity as rayacc runs on it (the
reclaim warning reaching Ray through `python -m rayacc.cluster.spot`, beside this)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rayacc.cluster.spec_files import SpecError, schema_errors

__all__ = ["check_launcher"]


def check_launcher(config: dict[str, Any]) -> None:
    """Ray's ray-schema.json, then the rules Ray applies in code before `ray up` starts nodes."""
    import json

    import ray
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    errors = schema_errors(config, schema)
    types = config.get("available_node_types") or {}
    head = config.get("head_node_type")
    if types and head not in types:
        errors.append(
            f"head_node_type: {head!r} is not one of available_node_types {sorted(types)}"
        )
    total_min = sum(t.get("min_workers", 0) for name, t in types.items() if name != head)
    if config.get("max_workers", 2) < total_min:
        errors.append(
            f"max_workers: {config.get('max_workers')} is below the sum of min_workers "
            f"({total_min})"
        )
    for name, t in types.items():
        if t.get("min_workers", 0) > t.get("max_workers", config.get("max_workers", 2)):
            errors.append(f"available_node_types.{name}: min_workers exceeds max_workers")
    image = (config.get("docker") or {}).get("image", "")
    if image:
        expected = f"rayproject/ray:{ray.__version__}-"
        if not image.startswith(expected):
            errors.append(
                f"docker.image: {image!r} is not the pinned {expected}* image of the "
                "Ray version rayacc uses (ray-ml images are deprecated)"
            )
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for cmd in config.get(key) or []:
            if "0.0.0.0" in cmd:
                errors.append(
                    f"{key}: {cmd!r} binds to every interface; bind to 127.0.0.1 and "
                    "tunnel over SSH"
                )
    errors += _spot_errors(config)
    if not errors:
        # the checks `ray up` itself runs (after filling the provider's defaults)
        import copy

        from ray.autoscaler._private.util import prepare_config, validate_config

        try:
            validate_config(prepare_config(copy.deepcopy(config)))
        except Exception as exc:
            errors.append(f"ray's validate_config: {exc}")
    if errors:
        raise SpecError("\n".join(errors))


def _spot_errors(config: dict[str, Any]) -> list[str]:
    """Spot capacity as rayacc runs on it: a reclaimed node is terminated (Ray launches a new
    one), and the cloud's reclaim warning reaches Ray through `python -m rayacc.cluster.spot`.
    On GCP every node type declares its CPUs and GPUs, which GCP's autoscaler does not detect."""
    errors: list[str] = []
    cloud = (config.get("provider") or {}).get("type")
    spot_types = []
    for name, t in (config.get("available_node_types") or {}).items():
        where = f"available_node_types.{name}"
        node = t.get("node_config") or {}
        if cloud == "aws" and "InstanceMarketOptions" in node:
            market = node["InstanceMarketOptions"] or {}
            options = market.get("SpotOptions") or {}
            if market.get("MarketType") != "spot":
                errors.append(f"{where}.node_config.InstanceMarketOptions.MarketType: use spot")
            if options.get("InstanceInterruptionBehavior", "terminate") != "terminate":
                errors.append(
                    f"{where}.node_config.InstanceMarketOptions.SpotOptions."
                    "InstanceInterruptionBehavior: use terminate (a stopped or hibernated "
                    "node is lost to Ray all the same; the autoscaler launches a new one)"
                )
            if options.get("SpotInstanceType", "one-time") != "one-time":
                errors.append(
                    f"{where}.node_config.InstanceMarketOptions.SpotOptions.SpotInstanceType: "
                    "use one-time (the autoscaler replaces reclaimed nodes itself)"
                )
            spot_types.append(name)
        if cloud == "gcp":
            scheduling = node.get("scheduling")
            if scheduling is not None and not isinstance(scheduling, dict):
                errors.append(
                    f"{where}.node_config.scheduling: Compute Engine takes one object "
                    "(provisioningModel, onHostMaintenance, ...), not a list"
                )
                scheduling = {}
            scheduling = scheduling or {}
            if scheduling.get("preemptible") or scheduling.get("provisioningModel") == "SPOT":
                if scheduling.get("provisioningModel") != "SPOT":
                    errors.append(
                        f"{where}.node_config.scheduling: use provisioningModel: SPOT "
                        "(preemptible VMs are the older kind, stopped after 24 h)"
                    )
                if scheduling.get("automaticRestart", True):
                    errors.append(
                        f"{where}.node_config.scheduling.automaticRestart: must be false "
                        "for Spot VMs"
                    )
                if scheduling.get("instanceTerminationAction") != "DELETE":
                    errors.append(
                        f"{where}.node_config.scheduling.instanceTerminationAction: use "
                        "DELETE (the autoscaler launches a new node)"
                    )
                spot_types.append(name)
            resources = t.get("resources") or {}
            gpus = sum(a.get("acceleratorCount", 0) for a in node.get("guestAccelerators") or [])
            if "CPU" not in resources or (gpus and resources.get("GPU") != gpus):
                errors.append(
                    f"{where}.resources: declare CPU{' and GPU: ' + str(gpus) if gpus else ''} "
                    "(GCP's autoscaler does not read them from the machine type)"
                )
    starts = " ".join(config.get("worker_start_ray_commands") or [])
    if spot_types and f"rayacc.cluster.spot --cloud {cloud}" not in starts:
        errors.append(
            f"worker_start_ray_commands: spot node types ({', '.join(spot_types)}) need "
            f"`python -m rayacc.cluster.spot --cloud {cloud}` started beside `ray start`, or a "
            "reclaim warning never reaches Ray Train"
        )
    return errors
