"""Plain-PyTorch models built from a ModelConfig (no Lightning, no I/O).

The package imports nothing: import from its modules (`attnlab.models.transformer.build_model`,
`attnlab.models.attention.KVCache`, ...), so that `attnlab.config` can read `attnlab.models.tables`
without importing the models, and so the config.
"""
