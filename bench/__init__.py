"""Benchmarks: performance claims live here, never in timed unit tests."""
