"""Test support: token data, corpora and checkpoints made for tests."""
