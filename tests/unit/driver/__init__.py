"""Unit tests: the driver's checks, places, runs, sample, secrets."""
