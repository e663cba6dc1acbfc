"""The Hugging Face hub: one remote file, resumable and checked, and a checkpoint's download."""
