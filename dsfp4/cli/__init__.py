"""The `dsfp4` command: one module per command group, the chat loop and its server client."""
