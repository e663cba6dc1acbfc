"""Fake models for the demo, the tests and the benchmarks: checkpoints in the official layouts, converted bench
models, routing traces."""
