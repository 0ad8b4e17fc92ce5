"""kvstore: a tiered KV-cache storage service for LLM inference engines."""

__version__ = "0.1.0"
