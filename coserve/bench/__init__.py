"""Benchmarks that drive the real engine, side by side with the peers."""
