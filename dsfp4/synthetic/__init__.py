"""Fake models for the demo, tests and benchmarks: tiny official-layout checkpoints, bench models, routing traces."""
