"""PSClient's calls for a worker's own loop (worker/own_loop.py): a round's squared norm
for clipping on the shards (RoundNorm, ps/server/update/clipping.py), and the optimizer
state of every slot (OptimizerState) for `optimizer.state_dict()`; rank 0's Init may
carry that state back (PSClient.init's `opt_state`).

A part of psar.ps.client.psclient.PSClient (it holds one), which provides the stubs, `_retrying`, `_each`,
`incarnations` and the config.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from psar.ps import wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb

StateBySlot = dict[str, dict[str, torch.Tensor]]
"""slot key -> optimizer state name -> fp32 value (flat, of the slot's size; or 0-d)."""


class OptimizerCalls:
    """A part of PSClient: RoundNorm and OptimizerState on the shards."""

    def __init__(self, client: Any) -> None:
        self.c = client
        """The PSClient this part serves: its stubs, retries and per-shard state."""

    def round_norm(self, clock: int) -> list[tuple[float, bool]]:
        """Every shard's part of round `clock`'s squared norm, and whether it skipped the
        round, in shard order (each waits until the round's pushes are all in)."""

        def one(i: int) -> tuple[float, bool]:
            req = pb.RoundNormRequest(
                worker=self.c.worker, clock=clock, incarnation=self.c.incarnations[i]
            )
            reply = self.c._retrying(
                i, lambda _r: self.c._stubs[i].RoundNorm(req, timeout=self.c.cfg.pull_timeout_s)
            )
            return reply.sq_norm, reply.skipped

        return self.c._each(one)

    def optimizer_state(self) -> StateBySlot:
        """The optimizer state of every slot of every shard."""

        def one(i: int) -> StateBySlot:
            def call(_retry: bool) -> StateBySlot:
                got: StateBySlot = {}
                req = pb.OptimizerStateRequest(worker=self.c.worker)
                for c in self.c._stubs[i].OptimizerState(req, timeout=self.c.cfg.timeout_s):
                    slot = got.setdefault(c.slot, {})
                    if c.name not in slot:
                        slot[c.name] = torch.empty(()) if c.scalar else torch.empty(c.numel)
                    flat = slot[c.name].view(-1)
                    piece = wire.decode(c.data, torch.float32)
                    flat[c.offset : c.offset + piece.numel()].copy_(piece)
                return got

            return self.c._retrying(i, call)

        out: StateBySlot = {}
        for part in self.c._each(one):
            out.update(part)
        return out


def state_chunks(state: StateBySlot, message_bytes: int) -> Iterator[pb.InitChunk]:
    """An Init's optimizer state pieces (after its data)."""
    for slot, values in state.items():
        for name, value in values.items():
            flat = value.detach().to(torch.float32).reshape(-1).contiguous()
            for off, data in wire.iter_pieces(flat, message_bytes):
                chunk = pb.StateChunk(slot=slot, name=name, numel=flat.numel(), offset=off,
                                      data=data, scalar=value.dim() == 0)  # fmt: skip
                yield pb.InitChunk(state=chunk)
