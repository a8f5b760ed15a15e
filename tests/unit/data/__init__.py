"""Unit tests: sources, data order, preparing data."""
