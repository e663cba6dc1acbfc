"""The MoE router: the experts' scores at decode, the group-limited top-k selection and its weights."""
