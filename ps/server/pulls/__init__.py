"""Pulls out: the pulls component (pulls.py: admit, wait for the update rule, answer from a
snapshot of the masters), early pulls (early.py) and pulls that wait parked on the event
loop instead of holding a thread (parking.py)."""
