"""The shard's doors: where requests come in and are decoded, and nothing is decided.

The gRPC servicer (servicer.py, the sparse tables' sparse_servicer.py) on an asyncio
server (aio_host.py, with the standard health service, health.py), and the TCP data plane
(dataplane.py: the listener; dataplane_conn.py: one connection's frames). Both doors
decode a push or a pull the same way and call the same components of the shard (its
intake and its pulls), so they refuse the same things with the same words."""
