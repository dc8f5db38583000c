"""Bench and study worker processes (one run each, so peak memory is its own)."""
