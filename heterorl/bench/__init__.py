"""Benchmark-style scripts (``heterorl bench ...``): long-running checks kept out of the test suite."""
