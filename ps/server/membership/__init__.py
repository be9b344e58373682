"""Who is in: the membership component (membership.py: the live set, registering,
rejoining, leaving, a push's clock and incarnation) and worker leases (leases.py)."""
