"""The tracker: the control plane. Keeps the coverage map, plans shards, answers routes.

Never imports torch (tests/test_architecture.py checks).
"""
