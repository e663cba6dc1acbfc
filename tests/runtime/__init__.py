"""runtime/: models, the expert store, the plan, generation, profiling."""
