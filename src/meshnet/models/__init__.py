"""Models: where checkpoints come from, which architectures exist, and how a span is loaded.

All architecture-specific code lives in this package behind `registry`; nothing outside it
names an architecture. `spec`, `sizing`, `source` and `registry` import no torch, so the
tracker can size layers from a config alone.
"""
