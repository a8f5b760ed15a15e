"""Unit tests: MLflow records and reports."""
