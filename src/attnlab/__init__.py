"""attnlab: Transformer research codebase (one typed config for every variant)."""

__version__ = "0.1.0"
