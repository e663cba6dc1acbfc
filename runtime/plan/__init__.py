"""Budgets in, placement out: the memory plan of a run."""
