"""What survives a crash: the durability component (durability.py: snapshots, restore,
rollback, draining) and the checkpoint files and their writer (checkpoints.py)."""
