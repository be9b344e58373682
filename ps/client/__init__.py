"""The worker's side of the parameter server: the client, its transports (gRPC and the
TCP data plane), the training backend, overlap and the sparse worker. It imports nothing
from ps/server/ (tests/test_walls.py)."""
