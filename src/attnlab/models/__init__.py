"""Plain-PyTorch models built from a ModelConfig (no Lightning, no I/O)."""

from .attention import KVCache
from .transformer import DecoderOnly, Encoder, EncoderDecoder, build_model

__all__ = ["KVCache", "DecoderOnly", "Encoder", "EncoderDecoder", "build_model"]
