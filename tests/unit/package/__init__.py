"""Unit tests: the package as a whole: layers, structure, Python floor, the credential matcher."""
