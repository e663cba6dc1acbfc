"""The on-disk contract shared by convert and runtime: formats, manifest, expert records."""
