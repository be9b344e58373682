"""ClientConfig is derived from the train config, not copied: the connection fields
(timeouts, reconnect, TLS, data plane) are declared once (psar.trainkit.connection), with one
default each and one check each, whichever config is built."""

from __future__ import annotations

import dataclasses

import pytest

from psar.ps.client.psclient import ClientConfig
from psar.trainkit.cli_gen import field_docs, flag_names
from psar.trainkit.config import PSConfig, TrainConfig
from psar.trainkit.connection import ConnectionConfig

SHARED = [f.name for f in dataclasses.fields(ConnectionConfig)]


def test_one_declaration_one_default() -> None:
    client, ps = ClientConfig(), PSConfig()
    for name in SHARED:
        assert getattr(client, name) == getattr(ps, name), name
    assert client.reconnect_timeout_s == ps.reconnect_timeout_s == 120.0


def test_the_client_config_of_a_train_config_carries_every_connection_field() -> None:
    ps = PSConfig(
        timeout_s=7.0,
        pull_timeout_s=8.0,
        reconnect_timeout_s=9.0,
        tls_ca="ca.pem",
        tls_server_name="shards.local",
        data_plane="grpc",
    )
    c = ClientConfig.of(ps, auth_token="t0k3n", message_bytes=1 << 16)
    assert {n: getattr(c, n) for n in SHARED} == {n: getattr(ps, n) for n in SHARED}
    assert (c.auth_token, c.message_bytes, c.tls) == ("t0k3n", 1 << 16, True)


def test_the_old_name_of_the_reconnect_timeout_still_constructs() -> None:
    c = ClientConfig(timeout_s=5.0, retry_timeout_s=0.5)
    assert c.reconnect_timeout_s == 0.5
    assert dataclasses.replace(c, reconnect_timeout_s=2.0).reconnect_timeout_s == 2.0
    assert dataclasses.replace(c, timeout_s=1.0).reconnect_timeout_s == 0.5


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"data_plane": "udp"}, "--data-plane: unknown 'udp'; accepted: auto, tcp, grpc"),
        ({"timeout_s": 0.0}, "--timeout-s and --pull-timeout-s must be > 0"),
    ],
)
def test_both_configs_refuse_alike(kw: dict, needle: str) -> None:
    for cls in (ClientConfig, PSConfig):
        with pytest.raises(ValueError) as e:
            cls(**kw)
        assert needle in str(e.value), cls


def test_the_flags_keep_their_names_and_help() -> None:
    flags = set(flag_names(TrainConfig))
    for name in SHARED:
        assert "--" + name.replace("_", "-") in flags
    docs = field_docs(PSConfig)
    assert set(SHARED) <= set(docs) and "unreachable shard" in docs["reconnect_timeout_s"]
