"""The data plane over TLS (issue #18): a shard started with --tls-cert serves its data
plane with the same certificate (and --tls-ca for mutual TLS) and the same token as gRPC,
so a secured job keeps the fast path. Real shards, real worker processes, real TLS.

- A TLS job (token too) trains over the data plane: `--data-plane tcp` (no fallback to
  gRPC), and the shard's data-plane counters saw every push and pull.
- A client that does not trust the shard's CA, or speaks plaintext, is refused; mutual TLS
  refuses a client without a certificate the CA signed; the token is still checked; a
  connection that never completes the handshake is closed at its deadline.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.client.tcp_transport import DataPlaneClient, DataPlaneError, client_ssl_context
from psar.ps.server.config import ServerConfig
from psar.ps.server.serve import start_server, stop_server
from tests.procs import run_ps_workers
from tests.ps_fixtures import grad_for, init_values, make_job, without_speculation
from tests.test_dataplane import header, items, pull_into
from tests.test_security import certs  # noqa: F401 - the fixture

SC = grpc.StatusCode
TIMEOUT = 10.0
STEPS = 6


@contextlib.contextmanager
def tls_shard(certs: Path, **kw: Any) -> Iterator[tuple[int, Any, Any]]:  # noqa: F811
    """(gRPC port, data plane, state) of a real TLS shard."""
    cfg = ServerConfig(
        bind="127.0.0.1:0",
        threads=8,
        tls_cert=str(certs / "server.pem"),
        tls_key=str(certs / "server.key"),
        **kw,
    )
    server, port, state = start_server(cfg)
    try:
        assert server.psar_dataplane is not None and server.psar_dataplane.tls
        yield port, server.psar_dataplane, state
    finally:
        stop_server(server)


def tls(certs: Path, ca: str = "ca", who: str = "") -> ssl.SSLContext:  # noqa: F811
    if not who:
        return client_ssl_context(str(certs / f"{ca}.pem"))
    return client_ssl_context(str(certs / f"{ca}.pem"), str(certs / f"{who}.pem"),
                              str(certs / f"{who}.key"))  # fmt: skip


@pytest.mark.parametrize("plane", ["tcp", "auto"])
def test_a_tls_job_trains_over_the_data_plane(certs: Path, tmp_path: Path, plane: str) -> None:  # noqa: F811
    """tcp and auto alike: every push and pull over the TLS data plane (auto keeps it
    under TLS: it measured faster than gRPC's TLS, docs/dataplane.md)."""
    (tmp_path / "token").write_text("tls-and-token\n")
    with tls_shard(certs, auth_token_file=str(tmp_path / "token")) as (port, dp, state):
        common = ["--workload", "mlp", "--steps", str(STEPS), "--batch-size", "16",
                  "--mode", "sync", "--seed", "1", "--precision", "fp32",
                  "--data-plane", plane,  # tcp: the data plane or a failure, no fallback
                  "--tls-ca", str(certs / "ca.pem"),
                  "--auth-token-file", str(tmp_path / "token")]  # fmt: skip
        reports = run_ps_workers([f"127.0.0.1:{port}"], 2, tmp_path, common)
        st = dp.stats()
        assert state.version == STEPS
    for r in reports:
        assert len(r["losses"]) == STEPS
    # Every step of both workers pushed and pulled through the TLS data plane, on pooled
    # connections (a TLS handshake per call would cost more than the encryption).
    assert st["pushes"] >= 2 * STEPS and st["pulls"] >= 2 * STEPS, st
    assert st["accepted"] <= 2 * 4, st
    # ... in standard TLS records from first byte to last: sealed records (ps/sealed.py)
    # are an opt-in of the shard (--data-sealed-records), never the default.
    assert st["sealed"] == 0, st


def test_the_data_port_is_advertised_under_tls(certs: Path) -> None:  # noqa: F811
    with tls_shard(certs) as (port, dp, _):
        creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
            reply = pb_grpc.ParameterServerStub(ch).GetJob(pb.GetJobRequest(), timeout=TIMEOUT)
        assert reply.data_port == dp.port > 0


def test_untrusted_ca_and_plaintext_are_refused(certs: Path) -> None:  # noqa: F811
    job = make_job("async", num_workers=1)
    with tls_shard(certs) as (_, dp, state):
        state.init(job, init_values(job))
        before = without_speculation(state.stats())
        with DataPlaneClient("127.0.0.1", dp.port, ssl_context=tls(certs, "rogue-ca")) as c:
            with pytest.raises(DataPlaneError) as e:
                c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
        assert e.value.code() == SC.UNAVAILABLE and "not trusted" in e.value.details()
        assert "--tls-ca" in e.value.details()
        with DataPlaneClient("127.0.0.1", dp.port) as c:  # plaintext to a TLS port
            with pytest.raises(DataPlaneError) as e:
                c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
        assert e.value.code() == SC.UNAVAILABLE
        # A name the certificate does not carry.
        with DataPlaneClient("127.0.0.1", dp.port, ssl_context=tls(certs),
                             server_name="shard.example") as c:  # fmt: skip
            with pytest.raises(DataPlaneError) as e:
                pull_into(c, job, 0, 0)
        assert e.value.code() == SC.UNAVAILABLE and "--tls-server-name" in e.value.details()
        assert without_speculation(state.stats()) == before
        assert dp.stats()["pushes"] == 0
        with DataPlaneClient("127.0.0.1", dp.port, ssl_context=tls(certs)) as c:
            assert c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT).applied
            assert pull_into(c, job, 0, 1)[0].version == 1


def test_mutual_tls_needs_a_client_certificate_the_ca_signed(certs: Path) -> None:  # noqa: F811
    job = make_job("async", num_workers=1)
    with tls_shard(certs, tls_ca=str(certs / "ca.pem")) as (_, dp, state):
        state.init(job, init_values(job))
        for ctx in (tls(certs), tls(certs, who="rogue-client")):
            with DataPlaneClient("127.0.0.1", dp.port, ssl_context=ctx) as c:
                with pytest.raises(DataPlaneError) as e:
                    pull_into(c, job, 0, 0)
            assert e.value.code() == SC.UNAVAILABLE
        assert dp.stats()["pulls"] == 0
        with DataPlaneClient("127.0.0.1", dp.port, ssl_context=tls(certs, who="client")) as c:
            assert pull_into(c, job, 0, 0)[0].version == 0


def test_the_token_is_still_checked_over_tls(certs: Path, tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / "token").write_text("s3cret\n")
    job = make_job("async", num_workers=1)
    with tls_shard(certs, auth_token_file=str(tmp_path / "token")) as (_, dp, state):
        state.init(job, init_values(job))
        for token, why in (("", "missing"), ("nope", "wrong")):
            with DataPlaneClient("127.0.0.1", dp.port, token=token, ssl_context=tls(certs)) as c:
                with pytest.raises(DataPlaneError) as e:
                    c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
            assert e.value.code() == SC.UNAUTHENTICATED and why in e.value.details()
        assert state.version == 0
        with DataPlaneClient("127.0.0.1", dp.port, token="s3cret", ssl_context=tls(certs)) as c:
            assert c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT).applied


def test_a_connection_that_never_completes_the_handshake_is_closed(certs: Path) -> None:  # noqa: F811
    with tls_shard(certs, data_idle_s=0.5) as (_, dp, _state):
        with socket.create_connection(("127.0.0.1", dp.port), timeout=TIMEOUT) as sock:
            assert sock.recv(1) == b""  # no ClientHello: closed at the handshake deadline
        end = time.monotonic() + TIMEOUT
        while dp.stats()["connections"] and time.monotonic() < end:
            time.sleep(0.02)
        assert dp.stats()["connections"] == 0 and dp.stats()["accepted"] == 1


@pytest.mark.parametrize(
    "sealed",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # the default run's 5 minutes
    ids=["tls-records", "sealed-records"],
)
def test_sparse_rows_travel_the_tls_data_plane(certs: Path, tmp_path: Path, sealed: bool) -> None:  # noqa: F811
    """A recsys job's row pulls and pushes take the TLS data plane too (no shared memory
    under TLS: the bytes are the frames' payloads), in TLS records or, where the shard
    opts in, sealed records; the job trains and the counters saw every row call."""
    with tls_shard(certs, data_sealed_records=sealed) as (port, dp, state):
        common = ["--workload", "recsys", "--workload-option", "rows=3000,500",
                  "--workload-option", "dim=8", "--workload-option", "samples=2048",
                  "--workload-option", "val_samples=0", "--eval-batches", "0",
                  "--steps", str(STEPS), "--batch-size", "32", "--mode", "sync",
                  "--seed", "1", "--precision", "fp32", "--data-plane", "tcp",
                  "--tls-ca", str(certs / "ca.pem")]  # fmt: skip
        reports = run_ps_workers([f"127.0.0.1:{port}"], 2, tmp_path, common)
        st = dp.stats()
        tables = state.sparse.stats()
    for r in reports:
        assert len(r["losses"]) == STEPS and r["sparse_bytes_pulled"] > 0
    # Every step of both workers: one pull of both tables (a tables_pull: the model names
    # its tables' ids up front) and one push of both tables.
    assert st["row_pulls"] == 2 * STEPS and st["row_pushes"] >= 2 * STEPS, st
    assert st["shm"] == 0 and (st["sealed"] > 0) == sealed, st
    assert all(t["version"] == STEPS for t in tables.values()), tables
