"""Unit tests: config and the derived quantities."""
