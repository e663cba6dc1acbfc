"""The expert store: records in device slots, pinned RAM and on the SSD under byte budgets, and a step's levers."""
