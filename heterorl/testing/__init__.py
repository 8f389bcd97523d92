"""Test helpers shipped with the package: network peer processes for tests and benchmarks."""
