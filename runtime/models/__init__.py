"""The model math: the protocol both families meet, the shared pieces, and one folder per family."""
