"""Benchmarks: scripts that print tables and write JSON (not tests)."""
