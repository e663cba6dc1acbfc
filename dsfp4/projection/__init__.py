"""The whole-model projection: the store simulated under a routing trace on a user's machine, for a model not here."""
