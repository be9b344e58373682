"""The parameter-server shard, one folder per part (docs/architecture.md has the map):

- shard.py composes the shard: its state as data (state.py) and its components,
  update/ (what rules are handed), intake/ (pushes), pulls/, membership/, durability/;
- modes/: one module per consistency mode (traits, configuration, update rule);
- sparse/: the sparse embedding tables; metrics/: what the shard records;
- the doors: the gRPC servicer and the TCP data plane; serve.py is `psar server`, config.py
  its flags.

It imports nothing from the worker (worker/, ps/client/) or from allreduce/
(tests/test_walls.py)."""
