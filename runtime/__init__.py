"""The runtime: model, expert store, generation (filled in by the runtime issue)."""
