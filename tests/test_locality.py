"""ps/client/locality.py: which shards are on this host (--early-pull's auto)."""

from __future__ import annotations

import pytest

from psar.ps.client.locality import any_remote, is_this_host, resolve_early_pull


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_is_this_host(host: str) -> None:
    assert is_this_host(host)


def test_an_address_of_another_host_is_not() -> None:
    # TEST-NET-3 (RFC 5737): no interface of any machine has it; binding it fails.
    assert not is_this_host("203.0.113.9")
    assert not is_this_host("no-such-host.invalid")
    assert any_remote(["127.0.0.1:50051", "203.0.113.9:50051"])
    assert not any_remote(["127.0.0.1:50051", "localhost:50052"])


def test_auto_pulls_early_only_where_it_can_pay() -> None:
    remote, local = ["203.0.113.9:1"], ["127.0.0.1:1"]
    assert resolve_early_pull(None, eligible=True, data_plane="auto", addresses=remote)
    assert not resolve_early_pull(None, eligible=True, data_plane="auto", addresses=local)
    assert not resolve_early_pull(None, eligible=True, data_plane="grpc", addresses=remote)
    assert not resolve_early_pull(None, eligible=False, data_plane="auto", addresses=remote)
    # Forced: on (where the mode has rounds to apply early) or off, wherever the shards are.
    assert resolve_early_pull(True, eligible=True, data_plane="auto", addresses=local)
    assert not resolve_early_pull(True, eligible=False, data_plane="auto", addresses=local)
    assert not resolve_early_pull(False, eligible=True, data_plane="auto", addresses=remote)
