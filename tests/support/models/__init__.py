"""Test support: test models and factories."""
