"""The OpenAI-compatible HTTP API an entry node serves."""
