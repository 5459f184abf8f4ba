"""The address of the client of a Django request (the admin), for its login lockout (django-axes).

The socket peer (`REMOTE_ADDR`, which daphne takes from the connection: it is started without
`--proxy-headers`), unless that peer is a trusted proxy (TRUSTED_PROXIES): then the
`X-Forwarded-For` list is read from its right end, each address a proxy appended, and the first
address that is not itself a trusted proxy is the client. What a client wrote at the left of that
header is never believed: the nginx site appends the address it saw (`$proxy_add_x_forwarded_for`),
so the right-most untrusted entry is the one a client cannot choose.

Without TRUSTED_PROXIES behind a proxy, every client is the proxy's address: the lockout then
locks the proxy, i.e. every operator, after a few failures from anyone (docs/security.md).
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.http import HttpRequest

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@lru_cache(maxsize=8)
def _networks(spec: tuple[str, ...]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in spec)


def parse_address(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    value = value.strip()
    if value.startswith("[") and "]" in value:  # [v6]:port
        value = value[1 : value.index("]")]
    elif value.count(":") == 1:  # v4:port
        value = value.partition(":")[0]
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        return None


def is_trusted(address: ipaddress.IPv4Address | ipaddress.IPv6Address | None, networks: tuple[Network, ...]) -> bool:
    return address is not None and any(address in network for network in networks)


def client_address(request: HttpRequest) -> str | None:
    """The client's address as a string (AXES_CLIENT_IP_CALLABLE)."""
    return address_of(request.META.get("REMOTE_ADDR") or None, request.META.get("HTTP_X_FORWARDED_FOR", ""))


def scope_client_address(scope: dict[str, Any]) -> str | None:
    """The same for an ASGI scope (Django's REMOTE_ADDR is the scope's `client` host)."""
    client = scope.get("client")
    peer = str(client[0]) if client else None
    forwarded = b",".join(value for name, value in scope.get("headers") or () if name.lower() == b"x-forwarded-for")
    return address_of(peer, forwarded.decode("latin-1"))


def address_of(peer: str | None, forwarded: str) -> str | None:
    networks = _networks(tuple(settings.TRUSTED_PROXIES))
    if peer is None or not networks or not is_trusted(parse_address(peer), networks):
        return peer
    entries = [part for part in forwarded.split(",") if part.strip()]
    for entry in reversed(entries):
        address = parse_address(entry)
        if address is None:
            return peer  # garbage where a proxy should have written an address: do not guess past it
        if not is_trusted(address, networks):
            return str(address)
    return peer  # only proxies (or no header): the nearest one is the client
