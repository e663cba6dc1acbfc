"""The runtime: the Engine and its options, generation, the model math, the expert store, the plan, profiling."""
