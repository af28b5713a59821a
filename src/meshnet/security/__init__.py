"""Who may call what: the swarm key (members), client API keys, and per-client limits.

Torch-free: the tracker uses all of it. See ADR-0017 (membership) and ADR-0018 (clients
and limits).
"""
