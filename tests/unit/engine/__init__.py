"""Unit tests: the engine on one process."""
