"""Unit tests: what a run tells its observers."""
