"""Test support: what spawned gloo ranks run, and the helpers that spawn them."""
