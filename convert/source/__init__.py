"""Reading a source checkpoint: its config.json into ModelArgs, its shards (local or fetched from the hub)."""
