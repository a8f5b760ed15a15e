"""Unit tests: the checkpoint layer."""
