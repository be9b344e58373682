"""Who may talk to a shard: TLS, mutual TLS and a bearer token refuse intruders; the
standard health service answers SERVING, then NOT_SERVING while draining.

Certificates are made at test time with the `cryptography` package (or the openssl
CLI); the tests skip, saying why, when neither is there.
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from psar.ps.client.psclient import ClientConfig, PSClient, PSClientError
from psar.ps.partition import plan_slots
from psar.ps.server.config import ServerConfig
from psar.ps.server.doors.health import check
from psar.ps.server.metrics.prometheus import ShardMetrics
from psar.ps.server.serve import shutdown, start_server, stop_server
from tests.ps_fixtures import PARAMS, init_values, make_job

FAST = {"timeout_s": 5.0, "pull_timeout_s": 5.0, "retry_timeout_s": 0.5}


# ---- certificates ---------------------------------------------------------------------


def _with_cryptography(d: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def key():  # noqa: ANN202
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject, pub, issuer, issuer_key, *, ca=False, san=None):  # noqa: ANN001, ANN202
        b = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(pub)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(stem: str, k, c) -> None:  # noqa: ANN001
        (d / f"{stem}.key").write_bytes(
            k.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        (d / f"{stem}.pem").write_bytes(c.public_bytes(serialization.Encoding.PEM))

    for ca_name in ("ca", "rogue-ca"):
        ca_key = key()
        ca_cert = cert(ca_name, ca_key.public_key(), ca_name, ca_key, ca=True)
        write(ca_name, ca_key, ca_cert)
        prefix = "" if ca_name == "ca" else "rogue-"
        for who in ("server", "client"):
            k = key()
            san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            write(f"{prefix}{who}", k, cert(who, k.public_key(), ca_name, ca_key, san=san))


def _with_openssl(d: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ext = d / "san.ext"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    for ca, prefix in (("ca", ""), ("rogue-ca", "rogue-")):
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1", "-subj", f"/CN={ca}")  # fmt: skip
        for who in ("server", "client"):
            stem = f"{prefix}{who}"
            run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", f"{stem}.key", "-out", f"{stem}.csr", "-subj", f"/CN={who}")  # fmt: skip
            run("x509", "-req", "-in", f"{stem}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                "-CAcreateserial", "-out", f"{stem}.pem", "-days", "1", "-extfile", str(ext))  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    try:
        _with_cryptography(d)
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available")
        _with_openssl(d)
    return d


# ---- helpers --------------------------------------------------------------------------


@pytest.fixture
def serve() -> Iterator:
    servers = []

    def start(**kw):  # noqa: ANN003, ANN202
        metrics = ShardMetrics()
        cfg = ServerConfig(bind="127.0.0.1:0", threads=8, **kw)
        server, port, state = start_server(cfg, metrics=metrics)
        servers.append(server)
        return f"127.0.0.1:{port}", state, metrics, server

    yield start
    for s in servers:
        stop_server(s)


def init_ok(addr: str, **kw: str) -> None:
    """Initialise the shard as rank 0 would, through the real client."""
    job = make_job("async", num_workers=1)
    with PSClient([addr], worker=0, cfg=ClientConfig(**FAST, **kw)) as c:
        c.set_slots(plan_slots(PARAMS, 1, chunk_bytes=32))
        assert c.init([job], init_values(job)) == [False]
        assert c.get_jobs(wait=False) == [job]


def refused(addr: str, code: grpc.StatusCode | None = None, **kw: str) -> PSClientError:
    """A call (Stats: it does not wait for a connection) is refused."""
    with PSClient([addr], worker=0, cfg=ClientConfig(**FAST, **kw)) as c:
        with pytest.raises(PSClientError) as e:
            c.stats()
    if code is not None:
        assert e.value.code == code, e.value
    return e.value


def unauthenticated(metrics: ShardMetrics) -> float:
    text = metrics.exposition().decode()
    for line in text.splitlines():
        if line.startswith("psar_ps_pushes_rejected_total") and 'reason="unauthenticated"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no unauthenticated series")


# ---- tests ----------------------------------------------------------------------------


def test_token_missing_or_wrong_is_unauthenticated_and_counted(tmp_path, serve) -> None:
    (tmp_path / "token").write_text("s3cret-token\n")
    (tmp_path / "wrong").write_text("guess\n")
    addr, state, metrics, _ = serve(auth_token_file=str(tmp_path / "token"))
    err = refused(addr, grpc.StatusCode.UNAUTHENTICATED)
    assert "missing bearer token" in err.details
    err = refused(addr, grpc.StatusCode.UNAUTHENTICATED, auth_token="guess")
    assert "wrong bearer token" in err.details
    assert unauthenticated(metrics) == 2
    assert not state.initialized
    init_ok(addr, auth_token="s3cret-token")
    assert state.initialized and unauthenticated(metrics) == 2
    # The health service stays open to probes without a token.
    with grpc.insecure_channel(addr) as ch:
        assert check(ch) == "SERVING"


def test_tls_server_refuses_plaintext_and_untrusted_clients(certs: Path, serve) -> None:
    addr, state, *_ = serve(tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key"))
    refused(addr, grpc.StatusCode.UNAVAILABLE)  # plaintext client: the handshake fails
    refused(addr, grpc.StatusCode.UNAVAILABLE, tls_ca=str(certs / "rogue-ca.pem"))
    assert not state.initialized
    init_ok(addr, tls_ca=str(certs / "ca.pem"))


def test_mutual_tls_refuses_a_client_without_the_right_certificate(certs: Path, serve) -> None:
    addr, state, *_ = serve(
        tls_cert=str(certs / "server.pem"),
        tls_key=str(certs / "server.key"),
        tls_ca=str(certs / "ca.pem"),
    )
    ca = str(certs / "ca.pem")
    refused(addr, tls_ca=ca)  # no client certificate
    refused(
        addr, tls_ca=ca, tls_cert=str(certs / "rogue-client.pem"), tls_key=str(certs / "rogue-client.key")
    )  # fmt: skip
    assert not state.initialized
    init_ok(addr, tls_ca=ca, tls_cert=str(certs / "client.pem"), tls_key=str(certs / "client.key"))


def test_tls_and_token_together(certs: Path, tmp_path, serve) -> None:
    (tmp_path / "token").write_text("both")
    addr, *_ = serve(
        tls_cert=str(certs / "server.pem"),
        tls_key=str(certs / "server.key"),
        auth_token_file=str(tmp_path / "token"),
    )
    ca = str(certs / "ca.pem")
    refused(addr, grpc.StatusCode.UNAUTHENTICATED, tls_ca=ca)
    init_ok(addr, tls_ca=ca, auth_token="both")


def test_health_serving_then_not_serving_while_draining(serve) -> None:
    addr, state, _, server = serve()
    with grpc.insecure_channel(addr) as ch:
        assert check(ch) == "SERVING"  # before Init: it must accept rank 0's Init
        assert check(ch, "psar.v1.ParameterServer") == "SERVING"
        job = make_job("sync", num_workers=1)
        state.init(job, init_values(job))
        state.durability.drain()
        server.psar_health.not_serving()
        assert check(ch) == "NOT_SERVING"
        with PSClient([addr], worker=0, cfg=ClientConfig(**FAST)) as c:
            c.set_slots(plan_slots(PARAMS, 1, chunk_bytes=32))
            with pytest.raises(PSClientError, match="draining"):
                c.push(clock=1, base_versions=[0], dtype=torch.float32,
                       grads={k: torch.zeros(v.numel()) for k, v in init_values(job).items()})  # fmt: skip
    shutdown(server, state, drain_timeout_s=1)


def test_bad_security_flags_are_user_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="tls-key"):
        ServerConfig(tls_cert="x.pem")
    with pytest.raises(ValueError, match="tls-cert"):
        ServerConfig(tls_ca="ca.pem")
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="auth-token-file"):
        start_server(ServerConfig(bind="127.0.0.1:0", auth_token_file=str(tmp_path / "empty")))
