"""The `dsfp4` command: one module per command group, their shared options, the chat loop and its server client."""
