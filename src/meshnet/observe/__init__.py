"""Seeing a running mesh: Prometheus metrics, session-tagged logs, progress of long work."""
