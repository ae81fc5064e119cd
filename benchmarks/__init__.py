"""Benchmarks whose numbers go into docs/ (run as modules: python -m benchmarks.NAME)."""
