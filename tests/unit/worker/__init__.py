"""Unit tests: a rank's side of a reclaim."""
