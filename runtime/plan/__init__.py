"""Budgets in, placement out: the memory plan of a run, and the quick machine probes a run starts with."""
