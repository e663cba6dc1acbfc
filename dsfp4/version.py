"""The one version number: the package's (pyproject.toml reads it) and what manifests record as their writer."""

__version__ = "0.1.0"
