"""Messages and frames for the hostile-input tests (#18): seeded mutations of valid
gRPC push / Init streams and data-plane frame streams, and their replay on a mirror.

The replay runs a request on an in-process ShardState the way the real shard's door runs
it (the servicer's PushCall for both; a data-plane connection's frame loop), so a test
can tell what the real shard should have done with any byte stream it was sent.
"""

from __future__ import annotations

import random
import struct
from typing import Any

from google.protobuf.message import DecodeError

from psar.ps import framing as fr
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import PSError
from psar.ps.server.doors.calls import PushCall
from psar.ps.server.shard import ShardState

MAX_MESSAGE = 1 << 20
"""The shard's --max-message-bytes in these tests (also the data plane's payload cap)."""
GARBAGE = b"\xff\xff"  # not a protobuf message: field 31 with a truncated varint tag
HAS_ABSENT = "absent" in pb.PushHeader.DESCRIPTOR.fields_by_name
"""Pushes name the slots they have no gradient for (PushHeader.absent): mutate it too."""


# ---- mutations -----------------------------------------------------------------------

U64 = [0, 1, 2, 3, 2**31, 2**62, 2**62 + 1, 2**63, 2**64 - 1]

FLOATS = [float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 5e-324, 1e-45, 3.4e38, 1e300]
KEYS = ["nope#0", "", "fc1.weight", "fc1.weight#0" * 5000, "fc2.bias#0\x00", "fc1.bias#0"]


def _u64(x: int) -> int:
    """x, at most uint64's largest (a field mutated twice in one request: its + 1 of
    2**64 - 1 would not fit the field, and the harness would raise, not the shard)."""
    return min(x, 2**64 - 1)


class Mutator:
    """Seeded mutations of a request given as a list of protobuf messages."""

    def __init__(self, seed: int, incarnation: int) -> None:
        self.rng = random.Random(seed)
        self.incarnation = incarnation

    def header_field(self, h: pb.PushHeader) -> str:
        r = self.rng
        name = r.choice(["worker", "clock", "base_version", "dtype", "loss_scale", "overflow",
                         "retry", "verdict_follows", "incarnation",
                         *(["absent"] if HAS_ABSENT else [])])  # fmt: skip
        if name == "worker":
            h.worker = r.choice([1, 2, 7, 2**32 - 1])
        elif name in ("clock", "base_version"):
            cur = getattr(h, name)
            setattr(h, name, r.choice([*U64, max(cur - 1, 0), _u64(cur + 1), _u64(cur + 2)]))
        elif name == "dtype":
            h.dtype = r.choice([0, 1, 2, 3, 4, 5, 99, 2**31 - 1])
        elif name == "loss_scale":
            h.loss_scale = r.choice(FLOATS)
        elif name == "absent":  # slots without a gradient: real, unknown, repeated, many
            h.absent.extend(r.choice([["fc1.bias#0"], ["nope#0"], ["fc2.bias#0"] * 2,
                                      [KEYS[3]], ["fc1.bias#0"] * 5000]))  # fmt: skip
        elif name == "incarnation":
            h.incarnation = r.choice([0, _u64(self.incarnation + 1), 2**64 - 1, 12345])
        else:
            setattr(h, name, not getattr(h, name))
        return f"header.{name}"

    def job_field(self, job: pb.JobSpec) -> str:
        """An Init's job: other sizes, counts, modes (the shard holds one job already)."""
        r = self.rng
        name = r.choice(["num_workers", "mode", "numel", "slot", "staleness", "lr"])
        if name == "num_workers":
            job.num_workers = r.choice([0, 1, 3, 2**32 - 1])
        elif name == "mode":
            job.mode = r.choice([0, 1, 2, 3, 9])
        elif name == "numel":
            job.slots[r.randrange(len(job.slots))].numel = r.choice([0, 1, 2**30, 2**40, 2**63])
        elif name == "slot":
            job.slots.add(key=r.choice(KEYS), param="x", start=0, numel=r.choice([1, 2**40]))
        elif name == "staleness":
            job.staleness = r.choice([1, 2**31 - 1])
        else:
            job.optimizer.lr = r.choice(FLOATS)
        return f"job.{name}"

    def piece_field(self, d: pb.TensorData) -> str:
        """A piece's key, offset or bytes (maybe none at all)."""
        r = self.rng
        what = r.choice(["key", "offset", "short", "long", "nan", "empty"])
        if what == "key":
            d.key = r.choice(KEYS)
        elif what == "offset":
            d.offset = r.choice([*U64, _u64(d.offset + 1), max(d.offset - 1, 0)])
        elif what == "short":
            d.data = d.data[: r.randrange(0, max(len(d.data), 2))]
        elif what == "long":
            d.data = d.data + bytes(r.choice([1, 2, 4, 8, 64]))
        elif what == "nan":
            bad = r.choice([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x7e", b"\xc0\x7f"])
            i = r.randrange(max(len(d.data) - len(bad), 1))
            d.data = d.data[:i] + bad + d.data[i + len(bad) :]
        else:
            d.data = b""
        return f"piece.{what}"

    def structure(self, msgs: list[Any], extras: list[Any]) -> str:
        """Drop, duplicate, move or insert a message (`extras`: foreign ones to insert)."""
        r = self.rng
        what = r.choice(["drop", "dup", "move", "extra"])
        i = r.randrange(len(msgs))
        if what == "drop":
            del msgs[i]
        elif what == "dup":
            msgs.insert(r.randrange(len(msgs) + 1), msgs[i])
        elif what == "move":
            m = msgs.pop(i)
            msgs.insert(r.randrange(len(msgs) + 1), m)
        else:
            msgs.insert(r.randrange(len(msgs) + 1), r.choice(extras))
        return what

    def bytes_of(self, raw: list[bytes]) -> str:
        """Byte-level damage to serialized messages: flips, truncation, bad tails."""
        r = self.rng
        what = r.choice(["flip", "flip", "truncate", "tail", "splice"])
        i = r.randrange(len(raw))
        b = bytearray(raw[i])
        if what == "flip" and b:
            for _ in range(r.randint(1, 4)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
        elif what == "truncate" and b:
            b = b[: r.randrange(len(b))]
        elif what == "tail":
            raw.append(r.choice([GARBAGE, bytes(r.randrange(256) for _ in range(9)), b"\x0a"]))
            return what
        else:
            b = bytearray(r.randrange(256) for _ in range(r.randint(1, 40)))
        raw[i] = bytes(b)
        return what

    def push_stream(self, chunks: list[pb.PushChunk]) -> tuple[list[bytes], list[str]]:
        """1-3 mutations of a valid push stream; the raw messages and what was done."""
        r = self.rng
        chunks = [_copy(c) for c in chunks]
        done = []
        kind_of = type(chunks[0])  # PushChunk, or InitChunk (the same shapes)
        extras = [
            kind_of(),
            kind_of(header=chunks[0].header),
            kind_of(data=pb.TensorData(key="fc2.bias#0", offset=0, data=bytes(40))),
        ]
        if kind_of is pb.PushChunk:
            extras.append(pb.PushChunk(verdict=verdict(r)))
        for _ in range(r.randint(1, 3)):
            kind = r.choice(["header", "piece", "piece", "structure", "bytes"])
            if kind == "header" and chunks and chunks[0].HasField("header"):
                head = chunks[0].header
                done.append(
                    self.header_field(head) if kind_of is pb.PushChunk else self.job_field(head.job)
                )
            elif kind == "piece" and len(chunks) > 1:
                c = r.choice([c for c in chunks[1:] if c.HasField("data")] or [None])
                if c is not None:
                    done.append(self.piece_field(c.data))
            elif kind == "structure" and chunks:
                done.append(self.structure(chunks, extras))
        raw = [c.SerializeToString() for c in chunks]
        if raw and (r.random() < 0.3 or not done):
            done.append(self.bytes_of(raw))
        return raw, done


def verdict(r: random.Random) -> pb.PushVerdict:
    """A verdict to insert: overflow or not, maybe naming slots without a gradient."""
    v = pb.PushVerdict(overflow=r.random() < 0.5)
    if HAS_ABSENT and r.random() < 0.3:
        v.absent.extend(r.choice([["fc1.bias#0"], ["nope#0"], ["fc2.bias#0"] * 2]))
    return v


def _copy(m: Any) -> Any:
    out = type(m)()
    out.CopyFrom(m)
    return out


# ---- the mirror's replay of what the real shard accepted ------------------------------


def replay_grpc_push(mirror: ShardState, raw: list[bytes]) -> bool:
    """Run a raw gRPC push stream through the servicer's PushCall on the mirror, as the
    real shard's Push handler does; returns whether it was applied."""
    try:
        chunks = [pb.PushChunk.FromString(m) for m in raw]
    except DecodeError:
        return False  # grpc refuses the stream (and nothing of it may be applied)
    if any(len(m) > MAX_MESSAGE for m in raw) or not chunks:
        return False
    if chunks[0].WhichOneof("kind") != "header":
        return False
    return replay_push(mirror, chunks[0].header, [as_item(c) for c in chunks[1:]])


def as_item(c: pb.PushChunk) -> tuple[str | None, Any, bytes]:
    kind = c.WhichOneof("kind")
    if kind == "data":
        return "piece", c.data, c.data.data
    if kind == "verdict":
        return "verdict", c.verdict, b""
    return kind, None, b""


def replay_push(mirror: ShardState, head: pb.PushHeader, items: list[tuple]) -> bool:
    try:
        call = PushCall(mirror, head)
    except PSError:
        return False
    try:
        for kind, msg, data in items:
            if kind == "piece":
                call.piece_bytes(msg.key, msg.offset, data)
            elif kind == "verdict":
                call.verdict(msg)
            else:
                call.misplaced(kind)
        call.finish()
        return True
    except PSError:
        return False
    finally:
        call.release()


# ---- the data plane: frames, mutations, replay ---------------------------------------

Frame = tuple[pb.DataFrame, bytes]


def hello_frame(version: int = fr.VERSION, token: str = "") -> Frame:
    return pb.DataFrame(hello=pb.DataHello(token=token, version=version)), b""


def push_frames(chunks: list[pb.PushChunk], token: str = "") -> list[Frame]:
    """The data-plane form of a valid gRPC push stream (hello first)."""
    out: list[Frame] = [hello_frame(token=token)]
    for c in chunks:
        kind = c.WhichOneof("kind")
        if kind == "header":
            out.append((pb.DataFrame(push_header=c.header), b""))
        elif kind == "data":
            piece = pb.DataPiece(key=c.data.key, offset=c.data.offset)
            out.append((pb.DataFrame(piece=piece), c.data.data))
        else:
            out.append((pb.DataFrame(verdict=c.verdict), b""))
    out.append((pb.DataFrame(end=pb.DataEnd()), b""))
    return out


def encode_frames(frames: list[Frame]) -> bytes:
    return b"".join(fr.encode(f, len(p)) + p for f, p in frames)


def mutate_frames(m: Mutator, frames: list[Frame]) -> tuple[bytes, list[str]]:
    """1-3 mutations of a valid data-plane stream (frames, then maybe its bytes)."""
    r = m.rng
    frames = [(_copy(f), p) for f, p in frames]
    done: list[str] = []
    extras: list[Frame] = [
        (pb.DataFrame(), b""),
        hello_frame(),
        (pb.DataFrame(end=pb.DataEnd()), b""),
        (pb.DataFrame(verdict=verdict(r)), b""),
        (pb.DataFrame(pull_request=pb.DataPullRequest(
            request=pb.PullRequest(worker=0, dtype=pb.FLOAT32), timeout_s=1.0)), b""),
        (pb.DataFrame(status=pb.DataStatus(code=0)), b""),
        (pb.DataFrame(push_reply=pb.PushReply(applied=True)), b""),
        (pb.DataFrame(end=pb.DataEnd()), bytes(8)),  # a payload on a non-piece frame
    ]  # fmt: skip
    for _ in range(r.randint(1, 3)):
        kind = r.choice(["header", "piece", "piece", "payload", "structure", "hello"])
        heads = [f for f, _ in frames if f.HasField("push_header")]
        pieces = [i for i, (f, _) in enumerate(frames) if f.HasField("piece")]
        if kind == "header" and heads:
            done.append(m.header_field(heads[0].push_header))
        elif kind == "piece" and pieces:
            f = frames[r.choice(pieces)][0]
            f.piece.key, f.piece.offset = (r.choice(KEYS), f.piece.offset) if r.random() < 0.5 \
                else (f.piece.key, r.choice([*U64, _u64(f.piece.offset + 1)]))  # fmt: skip
            done.append("piece.desc")
        elif kind == "payload" and pieces:
            i = r.choice(pieces)
            d = pb.TensorData(data=frames[i][1])
            done.append(m.piece_field(d))
            frames[i] = (frames[i][0], d.data)
        elif kind == "hello" and frames and frames[0][0].HasField("hello"):
            choice = r.choice(["drop", "version", "token", "no-token", "long-token"])
            token = frames[0][0].hello.token
            if choice == "drop":
                del frames[0]
            elif choice == "version":
                frames[0] = hello_frame(r.choice([0, 2, 2**32 - 1]), token)
            else:
                bad = {"token": token[:-1] + "X", "no-token": "", "long-token": token * 4000}
                frames[0] = hello_frame(fr.VERSION, bad[choice])
            done.append(f"hello.{choice}")
        elif kind == "structure" and len(frames) > 1:
            rest = frames[1:]
            done.append(m.structure(rest, extras))
            frames = frames[:1] + rest
    data = bytearray(encode_frames(frames))
    if data and (r.random() < 0.35 or not done):
        what = r.choice(["flip", "flip-prefix", "truncate", "tail", "claim"])
        if what == "flip":
            for _ in range(r.randint(1, 4)):
                data[r.randrange(len(data))] ^= 1 << r.randrange(8)
        elif what == "flip-prefix":  # the 16-byte prefix of some frame
            starts = frame_starts(bytes(data))
            at = r.choice(starts) + r.randrange(fr.PREFIX.size)
            if at < len(data):
                data[at] ^= 1 << r.randrange(8)
        elif what == "truncate":
            data = data[: r.randrange(len(data))]
        elif what == "tail":
            data += r.choice([GARBAGE, fr.PREFIX.pack(fr.MAGIC, 2, 0) + GARBAGE, b"PSD"])
        else:  # a frame whose prefix claims more than follows
            claim = r.choice([MAX_MESSAGE, MAX_MESSAGE + 1, 2**32 - 1, 2**64 - 1])
            head = pb.DataFrame(piece=pb.DataPiece(key="fc2.bias#0")).SerializeToString()
            data += fr.PREFIX.pack(fr.MAGIC, len(head), claim) + head + bytes(16)
        done.append(f"bytes.{what}")
    return bytes(data), done


def frame_starts(data: bytes) -> list[int]:
    out, pos = [], 0
    while pos + fr.PREFIX.size <= len(data):
        out.append(pos)
        _, hlen, plen = fr.PREFIX.unpack_from(data, pos)
        pos += fr.PREFIX.size + hlen + plen
    return out or [0]


def parse_frames(data: bytes) -> list[Frame | None]:
    """Split a byte stream into frames the way the shard reads it (ps/framing.py); a
    None at the end: a frame the shard refuses or cannot finish reading."""
    out: list[Frame | None] = []
    pos = 0
    while pos < len(data):
        if pos + fr.PREFIX.size > len(data):
            return [*out, None]
        magic, hlen, plen = fr.PREFIX.unpack_from(data, pos)
        if magic != fr.MAGIC or hlen > fr.MAX_HEADER_BYTES or plen > MAX_MESSAGE:
            return [*out, None]
        body = pos + fr.PREFIX.size
        if body + hlen > len(data):
            return [*out, None]
        try:
            f = pb.DataFrame.FromString(data[body : body + hlen])
        except DecodeError:
            return [*out, None]
        kind = f.WhichOneof("kind")
        if kind is None or (plen and kind != "piece") or body + hlen + plen > len(data):
            return [*out, None]
        out.append((f, data[body + hlen : body + hlen + plen]))
        pos = body + hlen + plen
    return out


def replay_data_plane(mirror: ShardState, data: bytes, token: str = "") -> int:
    """Run a data-plane byte stream on the mirror as a connection of the real shard
    handles it (hello, then calls; a refused push drops its frames up to its end);
    returns how many pushes were applied."""
    frames = parse_frames(data)
    if not frames or frames[0] is None or not frames[0][0].HasField("hello"):
        return 0
    hello = frames[0][0].hello
    if token and hello.token != token:
        return 0
    if hello.version != fr.VERSION:  # a token is ignored by a shard without one
        return 0
    applied, i = 0, 1
    while i < len(frames) and frames[i] is not None:
        f, _ = frames[i]  # type: ignore[misc]
        kind = f.WhichOneof("kind")
        if kind == "pull_request":
            i += 1
            continue
        if kind != "push_header":
            return applied  # the shard closes the connection
        j = i + 1
        while j < len(frames) and frames[j] is not None and not frames[j][0].HasField("end"):
            j += 1
        if j >= len(frames) or frames[j] is None:
            return applied  # cut before its end: the push is dropped
        items = []
        for g, payload in frames[i + 1 : j]:  # type: ignore[misc]
            k = g.WhichOneof("kind")
            items.append(("piece", g.piece, payload) if k == "piece" else
                         (k, g.verdict if k == "verdict" else None, b""))  # fmt: skip
        applied += replay_push(mirror, f.push_header, items)
        i = j + 1
    return applied


def prefix(hlen: int, plen: int, magic: bytes = fr.MAGIC) -> bytes:
    return struct.pack("<4sIQ", magic, hlen, plen)
