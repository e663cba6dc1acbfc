"""convert/: sources, name maps, the conversion pipeline."""
