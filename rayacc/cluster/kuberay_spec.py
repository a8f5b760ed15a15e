"""KubeRay manifests (cluster/kuberay/): a strict schema of the fields rayacc uses, the head's
exposure, its NetworkPolicy, and spot worker groups that drain their Ray node on a reclaim."""

from __future__ import annotations

from typing import Any

from rayacc.cluster.spec_files import SpecError, schema_errors

__all__ = ["check_kuberay"]


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
        "lifecycle": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "preStop": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["exec"],
                    "properties": {
                        "exec": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["command"],
                            "properties": {
                                "command": {"type": "array", "items": {"type": "string"}}
                            },
                        }
                    },
                }
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
                "nodeSelector": _STR_MAP,
                "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
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


SPOT_NODE_LABELS = {
    "cloud.google.com/gke-spot": "true",
    "eks.amazonaws.com/capacityType": "SPOT",
    "karpenter.sh/capacity-type": "spot",
    "kubernetes.azure.com/scalesetpriority": "spot",
}
"""Node labels of spot capacity (GKE, EKS managed node groups, Karpenter, AKS)."""
SPOT_TAINTS = {
    "cloud.google.com/gke-spot": "cloud.google.com/gke-spot",
    "kubernetes.azure.com/scalesetpriority": "kubernetes.azure.com/scalesetpriority",
}
"""The taint a spot pool of that label carries (GKE when asked to, AKS always)."""


def _spot_group_errors(i: int, group: dict[str, Any]) -> list[str]:
    """A worker group on spot nodes tolerates their taint and drains its Ray node for
    preemption when Kubernetes stops the pod (a preStop hook), with a grace period longer than
    the deadline it announces: that drain is the notice Ray Train's ranks checkpoint on."""
    spec = group["template"]["spec"]
    selector = spec.get("nodeSelector") or {}
    spot = [k for k, v in selector.items() if SPOT_NODE_LABELS.get(k) == v]
    if not spot:
        return []
    where = f"spec.workerGroupSpecs.{i}"
    errors = []
    tolerated = {t.get("key") for t in spec.get("tolerations") or []}
    for label in spot:
        taint = SPOT_TAINTS.get(label)
        if taint and taint not in tolerated:
            errors.append(f"{where}: add a toleration for the spot taint {taint}")
    drains = [
        c["lifecycle"]["preStop"]["exec"]["command"]
        for c in spec["containers"]
        if (c.get("lifecycle") or {}).get("preStop")
    ]
    drain = next((cmd for cmd in drains if "DRAIN_NODE_REASON_PREEMPTION" in " ".join(cmd)), None)
    if drain is None:
        return [
            *errors,
            f"{where}: a spot group needs a preStop hook that runs `ray drain-node "
            "--reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N` (or a "
            "reclaim reaches Ray Train without notice)",
        ]
    import re

    m = re.search(r"--deadline-remaining-seconds[= ](\d+)", " ".join(drain))
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if m is None:
        errors.append(f"{where}: the preStop drain gives no --deadline-remaining-seconds")
    elif grace <= int(m.group(1)):
        errors.append(
            f"{where}: terminationGracePeriodSeconds {grace} must exceed the drain's deadline "
            f"({m.group(1)} s), or the pod is killed before the ranks' last checkpoint"
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
    errors = schema_errors(doc, schema)
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
            errors += _spot_group_errors(i, group)
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
