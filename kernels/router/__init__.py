"""The MoE router at decode: expert scores and the group-limited top-k selection."""
