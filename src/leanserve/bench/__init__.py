"""Benchmarks that ship with the package (`leanserve bench ...`)."""
