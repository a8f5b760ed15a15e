"""Checks of the committed cluster specs: Ray cluster launcher YAML (Ray's own JSON schema plus
the rules Ray checks in code) and KubeRay manifests (a strict schema of the fields rayacc uses)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["SpecError", "check_kuberay", "check_launcher", "load_yaml"]


class SpecError(ValueError):
    pass


def load_yaml(path: str | Path) -> Any:
    return yaml.safe_load(Path(path).read_text())


def _schema_errors(doc: Any, schema: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    ]


def check_launcher(config: dict[str, Any]) -> None:
    """Ray's ray-schema.json, then the rules Ray applies in code before `ray up` starts nodes."""
    import json

    import ray
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    errors = _schema_errors(config, schema)
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


_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_QUANTITIES = {"type": "object", "additionalProperties": {"type": "string"}}
_RESOURCES = {
    "type": "object",
    "additionalProperties": False,
    "required": ["requests", "limits"],
    "properties": {"requests": _QUANTITIES, "limits": _QUANTITIES},
}
_CONTAINER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "image", "resources"],
    "properties": {
        "name": {"type": "string"},
        "image": {"type": "string"},
        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        "command": {"type": "array", "items": {"type": "string"}},
        "env": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "value"],
                "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
            },
        },
        "resources": _RESOURCES,
        "ports": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["containerPort"],
                "properties": {"containerPort": {"type": "integer"}, "name": {"type": "string"}},
            },
        },
        "volumeMounts": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "mountPath"],
                "properties": {"name": {"type": "string"}, "mountPath": {"type": "string"}},
            },
        },
    },
}
_POD_TEMPLATE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["containers"],
            "properties": {
                "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
                "containers": {"type": "array", "minItems": 1, "items": _CONTAINER},
                "tolerations": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "key": {"type": "string"},
                            "operator": {"enum": ["Exists", "Equal"]},
                            "value": {"type": "string"},
                            "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
                        },
                    },
                },
                "volumes": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string"},
                            "persistentVolumeClaim": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["claimName"],
                                "properties": {"claimName": {"type": "string"}},
                            },
                        },
                    },
                },
            },
        }
    },
}
_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "labels": _STR_MAP},
}
RAYCLUSTER_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["rayVersion", "headGroupSpec", "workerGroupSpecs"],
            "properties": {
                "rayVersion": {"type": "string"},
                "enableInTreeAutoscaling": {"type": "boolean"},
                "autoscalerOptions": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "version": {"enum": ["v1", "v2"]},
                        "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                        "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
                        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                    },
                },
                "headGroupSpec": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["rayStartParams", "template"],
                    "properties": {
                        "rayStartParams": _STR_MAP,
                        "template": _POD_TEMPLATE,
                        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                    },
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": [
                            "groupName",
                            "replicas",
                            "minReplicas",
                            "maxReplicas",
                            "rayStartParams",
                            "template",
                        ],
                        "properties": {
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 0},
                            "minReplicas": {"type": "integer", "minimum": 0},
                            "maxReplicas": {"type": "integer", "minimum": 1},
                            "rayStartParams": _STR_MAP,
                            "template": _POD_TEMPLATE,
                        },
                    },
                },
            },
        },
    },
}
RAYJOB_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["entrypoint"],
            "properties": {
                "entrypoint": {"type": "string"},
                "clusterSelector": _STR_MAP,
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode"]},
                "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                "backoffLimit": {"type": "integer", "minimum": 0},
                "shutdownAfterJobFinishes": {"type": "boolean"},
            },
        },
    },
}


NETWORKPOLICY_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "networking.k8s.io/v1"},
        "kind": {"const": "NetworkPolicy"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["podSelector", "policyTypes", "ingress"],
            "properties": {
                "podSelector": {"type": "object"},
                "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
                "ingress": {"type": "array"},
            },
        },
    },
}


def _head_exposure_errors(doc: dict[str, Any]) -> list[str]:
    """The head is reachable in the cluster (dashboard on all interfaces) and only there."""
    head = doc["spec"]["headGroupSpec"]
    errors = []
    if head["rayStartParams"].get("dashboard-host") != "0.0.0.0":
        errors.append(
            'spec.headGroupSpec.rayStartParams.dashboard-host: must be "0.0.0.0": a RayJob\'s '
            "submitter and the operator reach the dashboard through the head Service's pod IP"
        )
    if head.get("serviceType", "ClusterIP") != "ClusterIP":
        errors.append(
            f"spec.headGroupSpec.serviceType: {head['serviceType']} exposes the head outside the "
            "cluster; use ClusterIP (and kubectl port-forward)"
        )
    return errors


DASHBOARD_PORT = 8265


def _networkpolicy_errors(doc: dict[str, Any]) -> list[str]:
    """Ingress to the head from pods of the same namespace, and from the KubeRay operator's
    namespace on the dashboard port only (the operator polls it for a RayJob's status: without
    it a RayJob runs out its deadline and is marked failed)."""
    spec = doc["spec"]
    errors = []
    labels = spec["podSelector"].get("matchLabels", {})
    if labels.get("ray.io/node-type") != "head":
        errors.append("spec.podSelector: must select the head (ray.io/node-type: head)")
    if "Ingress" not in spec["policyTypes"]:
        errors.append("spec.policyTypes: must include Ingress")
    operator = False
    for i, rule in enumerate(spec["ingress"]):
        ports = {p.get("port") for p in rule.get("ports") or []}
        for j, peer in enumerate(rule.get("from") or [{}]):
            if set(peer) == {"podSelector"}:
                continue
            if "namespaceSelector" in peer and set(peer) <= {"namespaceSelector", "podSelector"}:
                if ports == {DASHBOARD_PORT}:
                    operator = True
                    continue
                errors.append(
                    f"spec.ingress.{i}: another namespace's pods may reach the dashboard port "
                    f"only (ports: [{{port: {DASHBOARD_PORT}}}]), not "
                    f"{sorted(ports) if ports else 'every port'}"
                )
                continue
            errors.append(
                f"spec.ingress.{i}.from.{j}: only podSelector peers (this namespace's pods) and "
                f"the operator's namespace may reach the head, not {sorted(peer) or 'everyone'}"
            )
    if not operator:
        errors.append(
            "spec.ingress: no rule admits the KubeRay operator's namespace on the dashboard port "
            f"{DASHBOARD_PORT}: the operator polls it for a RayJob's status, and without it the "
            "RayJob runs out its deadline. Fix: add a rule with a namespaceSelector of the "
            f"operator's namespace and ports: [{{port: {DASHBOARD_PORT}}}]"
        )
    return errors


def check_kuberay(doc: dict[str, Any]) -> None:
    """A strict schema of the fields rayacc's manifests use (unknown fields rejected,
    rayStartParams values strings, replicas explicit) plus a few rules of the operator, and
    the head's exposure: reachable in the cluster, from its namespace only."""
    kind = (doc or {}).get("kind")
    schema = {
        "RayCluster": RAYCLUSTER_SCHEMA,
        "RayJob": RAYJOB_SCHEMA,
        "NetworkPolicy": NETWORKPOLICY_SCHEMA,
    }.get(kind)
    if schema is None:
        raise SpecError(f"kind: {kind!r} is not RayCluster, RayJob or NetworkPolicy")
    errors = _schema_errors(doc, schema)
    if kind == "NetworkPolicy" and not errors:
        errors += _networkpolicy_errors(doc)
    if kind == "RayCluster" and not errors:
        errors += _head_exposure_errors(doc)
        import ray

        if doc["spec"]["rayVersion"] != ray.__version__:
            errors.append(
                f"spec.rayVersion: {doc['spec']['rayVersion']} is not the Ray version "
                f"rayacc uses ({ray.__version__})"
            )
        for i, group in enumerate(doc["spec"]["workerGroupSpecs"]):
            lo, hi, n = group["minReplicas"], group["maxReplicas"], group["replicas"]
            if not lo <= n <= hi:
                errors.append(
                    f"spec.workerGroupSpecs.{i}: replicas {n} outside "
                    f"[minReplicas {lo}, maxReplicas {hi}]"
                )
            gpus = group["rayStartParams"].get("num-gpus")
            for c in group["template"]["spec"]["containers"]:
                limit = c["resources"]["limits"].get("nvidia.com/gpu")
                if gpus is not None and limit != gpus:
                    errors.append(
                        f"spec.workerGroupSpecs.{i}: container {c['name']} limits "
                        f"nvidia.com/gpu={limit}, rayStartParams num-gpus={gpus}"
                    )
    if errors:
        raise SpecError("\n".join(errors))
