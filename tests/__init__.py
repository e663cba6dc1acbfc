"""The test suite: one folder per package, fixtures and shared helpers in fixtures/."""
