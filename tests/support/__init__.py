"""Shared helpers of the test suite (no tests here): gloo groups, test models, whole-stack
fits, the `rayacc` command, local clusters, an MLflow server, and the start-up counts."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""

LEAN_RAY_TRAIN = ("RAY_TRAIN_METRICS_ENABLED", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")
"""Ray Train features the suite's local Ray (`ray_local`) runs without: its Prometheus metrics
and its drain watcher (a multi-node cluster's runs keep them: tests/cluster/conftest.py)."""
