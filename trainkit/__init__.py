"""The training pieces both sides of the wire need, and nothing else of either side.

Optimizer, schedule and loss-scale construction (``optim``), gradient finiteness checks
(``finite``), precision names (``dtypes``), atomic file writes (``atomic``), role
resolution from launcher environments (``roles``), seeding a process from the job's seed
and its rank (``seeding``) and Prometheus helpers (``prom``). Shards (ps/server/), workers
(worker/, ps/client/) and DDP (allreduce/) import it; it imports none of them
(tests/test_walls.py).
"""
