"""Reading a source checkpoint: its config.json, its shards (local or fetched from the hub as needed)."""
