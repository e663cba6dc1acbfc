"""The model math: the protocol both families meet, loading, the shared pieces, and one folder per family."""
