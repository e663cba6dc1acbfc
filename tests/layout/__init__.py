"""layout/: formats, records, manifest, repack."""
