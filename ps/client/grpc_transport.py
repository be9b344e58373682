"""The gRPC door of the transport contract (ps/client/transport.py): Push and Pull streams.

A push is a client stream of PushChunk messages (header, then TensorData pieces of at
most --message-bytes and the verdict); a pull is a server stream (header, then pieces).
Protobuf needs its own bytes, so each pushed piece is copied once here; the checks, the
piece cutting and the landing of pulled bytes are the contract's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.transport import Incoming, Piece, PullStream, Transport, TransportError, Verdict


class GrpcTransport(Transport):
    """Push and pull to one shard over its gRPC service."""

    def __init__(self, stub: Callable[[], Any], address: str, *, piece_bytes: int) -> None:
        # The stub is looked up at each call (PSClient._stubs[i]): tests wrap it there.
        self._stub = stub
        self.address = address
        self._piece_bytes = piece_bytes
        self._pulls: set[_GrpcPull] = set()
        self._lock = threading.Lock()

    @property
    def piece_bytes(self) -> int:
        return self._piece_bytes

    def send_push(
        self, header: pb.PushHeader, parts: Iterator[Piece | Verdict], *, timeout_s: float
    ) -> pb.PushReply:
        failed: list[BaseException] = []

        def chunks() -> Iterator[pb.PushChunk]:
            yield pb.PushChunk(header=header)
            try:
                for part in parts:
                    if isinstance(part, Verdict):
                        verdict = part.to_pb()
                        yield pb.PushChunk(verdict=verdict)
                    else:
                        data = pb.TensorData(
                            key=part.key, offset=part.offset, data=bytes(part.data)
                        )
                        yield pb.PushChunk(data=data)
            except BaseException as e:
                failed.append(e)  # gRPC would only say "Exception iterating requests"
                raise

        try:
            return self._stub().Push(chunks(), timeout=timeout_s)
        except grpc.RpcError:
            if failed:  # a bad item: raise what the data plane raises for it too
                raise failed[0] from None
            raise

    def open_pull(self, req: pb.PullRequest, *, timeout_s: float) -> PullStream:
        pull = _GrpcPull(self, self._stub().Pull(req, timeout=timeout_s))
        with self._lock:
            self._pulls.add(pull)
        return pull

    def cancel_all(self) -> None:
        with self._lock:
            pulls = list(self._pulls)
        for p in pulls:
            p.cancel()

    def close(self) -> None:
        self.cancel_all()  # the channel is PSClient's: it closes it

    def _ended(self, pull: _GrpcPull) -> None:
        with self._lock:
            self._pulls.discard(pull)


class _BytesPiece:
    """A pulled piece whose bytes are already here (in its protobuf message)."""

    __slots__ = ("key", "offset", "nbytes", "_data")

    def __init__(self, data: pb.TensorData) -> None:
        self.key, self.offset, self._data = data.key, data.offset, data.data
        self.nbytes = len(self._data)

    def read_into(self, view: memoryview) -> None:
        view[:] = self._data

    def read(self) -> bytes:
        return self._data


class _GrpcPull(PullStream):
    def __init__(self, transport: GrpcTransport, call: Any) -> None:
        self._transport = transport
        self._call = call
        self._messages = iter(call)
        self._ended = False

    def _next(self, wanted: str) -> Any:
        msg = next(self._messages, None)
        if msg is None:
            self._ended = True
            if wanted == "header":
                raise TransportError(
                    grpc.StatusCode.INTERNAL, f"pull from {self._transport.address}: no header"
                )
            return None
        kind = msg.WhichOneof("kind")
        if kind != wanted:
            raise TransportError(
                grpc.StatusCode.INTERNAL,
                f"pull from {self._transport.address}: got a {kind} message, expected {wanted}",
            )
        return msg

    def header(self) -> pb.PullHeader:
        return self._next("header").header

    def next_early(self) -> Incoming | pb.PullHeader:
        # A shard's gRPC door answers an early pull as an ordinary one: header first.
        return self.header()

    def next_piece(self) -> Incoming | None:
        msg = self._next("data")
        return None if msg is None else _BytesPiece(msg.data)

    def cancel(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        if not self._ended:
            self._call.cancel()  # abandoned (an error, or a bad piece): stop the stream
        self._transport._ended(self)
