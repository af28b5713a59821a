"""meshnet: run language models too big for one machine across many machines over HTTP."""

__version__ = "0.1.0"
