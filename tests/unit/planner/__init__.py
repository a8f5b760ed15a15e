"""Unit tests: the plan search."""
