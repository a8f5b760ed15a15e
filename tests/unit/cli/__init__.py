"""Unit tests: the command line, and the boundaries generated from it."""
