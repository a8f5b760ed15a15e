"""Shared helpers of the test suite (no tests here): gloo groups, test models, whole-stack
fits, the `rayacc` command, local clusters, an MLflow server, and the start-up counts."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""
