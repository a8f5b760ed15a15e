"""Unit tests: cluster specs, the spot agent, local clusters."""
