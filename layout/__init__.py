"""The on-disk contract of convert and runtime: ModelArgs, formats, records, manifest, hot profile, traces, file I/O."""
