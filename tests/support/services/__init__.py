"""Test support: whole-stack fits, the `rayacc` command, local clusters, an MLflow server,
the start counts."""
