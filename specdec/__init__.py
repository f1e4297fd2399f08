"""specdec: distributed speculative decoding for Hugging Face causal language models."""

__version__ = "0.1.0"
