"""The admin's login lockout, checked before anything else looks at a login.

django-axes refuses a locked-out client's login in its authentication backend, first in
AUTHENTICATION_BACKENDS, so no password is hashed for it. But the login view runs all the same:
session, CSRF, the form, the login page rendered again, then replaced by AxesMiddleware with the
429: ~12 ms of CPU per refused try, 12 s per thousand. Here it is cut short twice:

- `LoginLockoutMiddleware`, before the session, CSRF and the view: a POST to the login page from
  a client axes has locked out gets its 429 after one indexed query (the client's failures), and
  the client is remembered as locked out for LOCKOUT_MEMORY_S;
- `guard(app)`, in front of Django's ASGI application: a remembered client's login is answered
  429 from that memory, before Django makes a request of it (~0.3 ms of CPU instead of ~1.6 ms:
  `bench/admin_logins.py`).

Each refusal is sent ADMIN_LOGIN_LOCKOUT_DELAY_S late (a sleep: no CPU): a script trying passwords
on one connection gets one answer a second, however fast it sends, so a flood's rate is its
connections' count (capped per address, GATEWAY_MAX_CONNECTIONS_PER_ADDRESS), not what the event
loop can answer.

The attempts refused here are not recorded (as AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT=False
does for those axes refuses itself): the cool-off runs from the last counted failure, and a flood
writes nothing and logs nothing (axes logged the lockout when it began).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from asgiref.sync import markcoroutinefunction, sync_to_async
from axes.handlers.proxy import AxesProxyHandler
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from disagg_project.client_address import client_address, scope_client_address

# How long a client seen locked out is refused from memory, without asking the database again.
# An operator's `manage.py axes_reset_ip` takes effect in every process within this time.
LOCKOUT_MEMORY_S = 5.0
# Bound on the remembered clients (a flood from many addresses cannot grow it without limit).
MAX_REMEMBERED = 10_000

LOCKED_OUT_BODY = b"Too many failed logins from this address. Try again later.\n"

# Client address → refused from memory until (time.monotonic()). One per process: the event loop's.
_locked: dict[str, float] = {}


def remembered(address: str) -> bool:
    until = _locked.get(address)
    if until is None:
        return False
    if until > time.monotonic():
        return True
    del _locked[address]
    return False


def remember(address: str) -> None:
    if len(_locked) >= MAX_REMEMBERED:
        _locked.clear()
    _locked[address] = time.monotonic() + LOCKOUT_MEMORY_S


def login_path() -> str:
    return "/" + settings.ADMIN_URL + "login/"


def guard(app: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Django's ASGI application, with the logins of remembered locked-out clients answered first."""
    path = login_path()

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope.get("type") == "http" and scope.get("method") == "POST" and scope.get("path") == path
            and _locked and remembered(scope_client_address(scope) or "")
        ):  # fmt: skip
            await asyncio.sleep(settings.ADMIN_LOGIN_LOCKOUT_DELAY_S)
            await _send_locked_out(send)
            return
        await app(scope, receive, send)

    return guarded


class LoginLockoutMiddleware:
    """Answers a locked-out client's POST to the admin's login page with 429, before the view."""

    async_capable = True
    sync_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        self.login_path = login_path()
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if request.method != "POST" or request.path_info != self.login_path or not settings.AXES_ENABLED:
            return await self.get_response(request)
        address = client_address(request) or ""
        # One login at a time per address (in this process). Django runs each request's view on a
        # thread of its own under ASGI, and axes checks the count before the password and records
        # the failure after it: fifty logins sent at once would all pass the check and all hash
        # their password (~12 s of CPU, measured) before the first failure was recorded.
        async with _turn(address):
            locked = remembered(address)
            if not locked and await sync_to_async(_is_locked)(request):
                remember(address)  # from the database: refused from memory for the next few seconds
                locked = True
            if not locked:
                return await self.get_response(request)
        await asyncio.sleep(settings.ADMIN_LOGIN_LOCKOUT_DELAY_S)
        return _locked_out()


# Client address → (its lock, [the logins holding or awaiting it], the loop it serves).
_turns: dict[str, tuple[asyncio.Lock, list[int], asyncio.AbstractEventLoop]] = {}


@asynccontextmanager
async def _turn(address: str) -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    entry = _turns.get(address)
    if entry is None or entry[2] is not loop:
        entry = _turns[address] = (asyncio.Lock(), [0], loop)
    lock, users, _ = entry
    users[0] += 1
    try:
        async with lock:
            yield
    finally:
        users[0] -= 1
        if not users[0] and _turns.get(address) is entry:
            del _turns[address]


def _is_locked(request: HttpRequest) -> bool:
    # The lockout parameter is the address alone (AXES_LOCKOUT_PARAMETERS): no credentials needed.
    return bool(AxesProxyHandler.is_locked(request))


def _retry_after() -> str:
    return str(max(1, int(settings.AXES_COOLOFF_TIME.total_seconds())))


def _locked_out() -> HttpResponse:
    response = HttpResponse(LOCKED_OUT_BODY, status=settings.AXES_HTTP_RESPONSE_CODE, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = _retry_after()
    response["Content-Length"] = str(len(LOCKED_OUT_BODY))
    response._has_been_logged = True  # type: ignore[attr-defined]  # Django's per-response log: not once per refused try
    return response


async def _send_locked_out(send: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": settings.AXES_HTTP_RESPONSE_CODE,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(LOCKED_OUT_BODY)).encode()),
                (b"retry-after", _retry_after().encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": LOCKED_OUT_BODY})
