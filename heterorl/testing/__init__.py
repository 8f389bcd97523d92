"""Test helpers shipped with the package (STYLE.md §15): network peer processes for tests and benchmarks."""
