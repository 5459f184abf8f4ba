"""disagg_project/client_address.py: the client address the login lockout locks, the socket peer,
or behind a trusted proxy the right-most X-Forwarded-For entry the proxy added."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import RequestFactory

from disagg_project.client_address import client_address

LOGIN = "/" + settings.ADMIN_URL + "login/"


@pytest.mark.parametrize(
    ("trusted", "peer", "forwarded", "expected"),
    [
        # No trusted proxy: the socket peer, whatever the client wrote.
        ([], "203.0.113.9", "198.51.100.1", "203.0.113.9"),
        ([], "127.0.0.1", "198.51.100.1", "127.0.0.1"),
        # From a trusted proxy: the right-most address it did not add itself...
        (["127.0.0.1"], "127.0.0.1", "198.51.100.1", "198.51.100.1"),
        # ... never what the client put at the left to look like someone else.
        (["127.0.0.1"], "127.0.0.1", "10.9.9.9, 198.51.100.1", "198.51.100.1"),
        # A chain of trusted proxies (a load balancer, then nginx).
        (["127.0.0.1", "10.0.0.0/8"], "127.0.0.1", "198.51.100.1, 10.0.0.5", "198.51.100.1"),
        # A peer that is not a trusted proxy cannot choose its address by the header.
        (["10.0.0.0/8"], "203.0.113.9", "198.51.100.1", "203.0.113.9"),
        # Nothing but proxies, or no header: the peer.
        (["127.0.0.1"], "127.0.0.1", "", "127.0.0.1"),
        # Garbage where the proxy's entry should be: not believed.
        (["127.0.0.1"], "127.0.0.1", "198.51.100.1, not-an-address", "127.0.0.1"),
        (["::1"], "::1", "2001:db8::5", "2001:db8::5"),
    ],
)
def test_client_address(monkeypatch: pytest.MonkeyPatch, trusted: list[str], peer: str, forwarded: str, expected: str) -> None:
    monkeypatch.setattr(settings, "TRUSTED_PROXIES", trusted)
    request = RequestFactory().post(LOGIN, REMOTE_ADDR=peer, HTTP_X_FORWARDED_FOR=forwarded)
    assert client_address(request) == expected
