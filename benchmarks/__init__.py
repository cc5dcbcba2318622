"""Benchmarks behind `kvpush bench ...`; results are committed under docs/benchmarks/."""
