"""The update of the masters: the component update rules are handed as their ShardView
(updates.py), the optimizer steps on several threads (stepper.py) and the model buffers a
shard keeps (buffers.py)."""
