"""Sparse embedding tables on a shard: its tables (tables.py: create, pull rows, push row
gradients, checkpoint) and one table's rows and row-wise optimizers (table.py). The row
rules they follow are the modes' (ps/server/modes/rows.py)."""
