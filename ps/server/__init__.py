"""The parameter-server shard: state, update policies, servicers, data-plane server,
checkpoints, membership, leases and sparse tables. It imports nothing from the worker
(worker/, ps/client/) or from allreduce/ (tests/test_walls.py)."""
