"""The face: the CLI, the server, the hub, the tools and the synthetic models."""
