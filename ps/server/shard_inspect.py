"""ShardState's read-only views: counters for Stats, and a digest of its whole state.

A mixin so ps/server/shard.py keeps to pushes, pulls and rounds.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ps import wire


class Inspection:
    """Needs ShardState's lock (_cond), masters, optimizer, counters and membership."""

    def stats(self) -> dict[str, Any]:
        with self._cond:
            hist_len = max(self.staleness_counts, default=-1) + 1
            m = self.checkpoints
            policy = getattr(self, "policy", None)  # none before init
            return {
                "version": self.version,
                "rounds": self.rounds,
                "updates_applied": self.updates_applied,
                "skipped_rounds": self.skipped_rounds,
                "dropped_nonfinite": self.dropped_nonfinite,
                "live_workers": len(self.live),
                "loss_scale": self.loss_scale.scale if self.job else 1.0,
                "worker_clocks": list(self.clocks),
                "max_clock_gap": self.max_clock_gap,
                "staleness_histogram": [self.staleness_counts[i] for i in range(hist_len)],
                "master_bytes": self.master_bytes,
                "state_digest": self.state_digest(),
                "incarnation": self.incarnation,
                "restores": self.restores,
                "restored_step": self.restored_step,
                "lease_expirations": self.lease_expirations,
                "rejoins": self.rejoins,
                "checkpoints_written": m.written if m is not None else 0,
                "last_checkpoint_step": (m.last_step or 0) if m is not None else 0,
                "live_worker_ids": sorted(self.live),
                "draining": self.draining,
                "chunks_applied_early": policy.chunks_early if policy is not None else 0,
                "chunk_undos": policy.chunk_undos if policy is not None else 0,
                "update_params_per_s": self.stepper.rate(),
                "early_pull_slots": policy.early_slots if policy is not None else 0,
                "early_pull_voids": policy.early_voids if policy is not None else 0,
                "push_paced_s": self.push_paced_s,
            }

    def state_digest(self) -> str:
        """sha256 of masters, optimizer state and counters: equal digests, equal state."""
        h = hashlib.sha256()
        with self._cond:
            if self.job is not None:
                self.policy.quiesce()
            h.update(f"{self.version}/{self.rounds}/{self.clocks}".encode())
            h.update(self.int_buffers.digest_text().encode())
            for key, p in self.masters.items():
                h.update(key.encode())
                h.update(wire.as_bytes_view(p.detach()))
            if self.job is not None:
                for key, p in self.masters.items():
                    for name, value in sorted(self.optimizer.state.get(p, {}).items()):
                        h.update(f"{key}.{name}".encode())
                        if isinstance(value, torch.Tensor):
                            h.update(wire.as_bytes_view(value.detach().reshape(-1).contiguous()))
                        else:
                            h.update(repr(value).encode())
                h.update(repr(self.loss_scale.scale).encode())
        return h.hexdigest()
