"""The context worker's KV handoffs: issued after prefill, held until taken or expired.

A handoff stands for the KV cache a context worker keeps after prefill. A generation worker
takes it over HTTP (`POST /sim/kv/take`) in one of two ways:

- context-first: it presents the `encoded_opaque_state` the context response carried; the
  handoff must be held and the state must verify, or the take is refused at once;
- generation-first (no state): a rendezvous, the take waits until the context request with
  that id finishes prefill, and fails at once if that request failed or was aborted.

Failures are remembered for a while (bounded), so a take arriving after the failure also
fails promptly instead of waiting out its timeout.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

TakeStatus = Literal["taken", "not_issued", "failed", "timeout"]


@dataclass(slots=True)
class Handoff:
    """A held KV cache."""

    ctx_request_id: int
    prompt_tokens: int
    first_gen_tokens: list[int]
    expires_at: float
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class TakeResult:
    status: TakeStatus
    message: str = ""
    handoff: Handoff | None = None


class OpaqueSigner:
    """Makes `encoded_opaque_state` values that only this process can have issued."""

    _PREFIX = b"simkv1:"

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or os.urandom(32)

    def _digest(self, ctx_request_id: int) -> bytes:
        message = str(ctx_request_id).encode()
        return hmac.new(self._secret, message, hashlib.sha256).digest()[:24]

    def sign(self, ctx_request_id: int) -> str:
        return base64.b64encode(self._PREFIX + self._digest(ctx_request_id)).decode()

    def verify(self, ctx_request_id: int, state: str) -> bool:
        try:
            raw = base64.b64decode(state, validate=True)
        except ValueError:
            return False
        expected = self._PREFIX + self._digest(ctx_request_id)
        return hmac.compare_digest(raw, expected)


class _FailureMemory:
    """Recent failures by id: bounded in size, each forgotten after `ttl` seconds."""

    def __init__(self, size: int, ttl: float) -> None:
        self._size = size
        self._ttl = ttl
        self._reasons: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def remember(self, key: int, reason: str, now: float) -> None:
        self._reasons[key] = (reason, now + self._ttl)
        self._reasons.move_to_end(key)
        while len(self._reasons) > self._size:
            self._reasons.popitem(last=False)

    def forget(self, key: int) -> None:
        self._reasons.pop(key, None)

    def get(self, key: int, now: float) -> str | None:
        entry = self._reasons.get(key)
        if entry is None:
            return None
        reason, expires_at = entry
        if expires_at <= now:
            del self._reasons[key]
            return None
        return reason


class HandoffStore:
    """All handoffs of one context worker. Must be used from its event loop."""

    def __init__(
        self,
        kv_timeout: float,
        *,
        signer: OpaqueSigner | None = None,
        failure_memory: int = 4096,
        failure_ttl: float | None = None,
    ) -> None:
        self.kv_timeout = kv_timeout
        self.signer = signer or OpaqueSigner()
        self._held: dict[int, Handoff] = {}
        self._waiters: dict[int, list[asyncio.Future[Handoff]]] = {}
        self._failures = _FailureMemory(failure_memory, failure_ttl or max(kv_timeout, 30.0))
        self.taken = 0
        self.expired = 0

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    def reset_counters(self) -> None:
        self.taken = 0
        self.expired = 0

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    # -- the context side -------------------------------------------------------------------

    def issue(self, ctx_request_id: int, prompt_tokens: int, first_gen_tokens: list[int]) -> str:
        """Files the handoff of a finished prefill; returns its `encoded_opaque_state`."""
        self._failures.forget(ctx_request_id)
        handoff = Handoff(
            ctx_request_id, prompt_tokens, first_gen_tokens, self._now() + self.kv_timeout
        )
        if not self._hand_to_waiter(handoff):
            self._hold(handoff)
        return self.signer.sign(ctx_request_id)

    def fail(self, ctx_request_id: int, reason: str) -> None:
        """Records that the context phase of this id failed; its waiters fail at once."""
        self._failures.remember(ctx_request_id, reason, self._now())
        handoff = self._held.pop(ctx_request_id, None)
        if handoff is not None and handoff.timer is not None:
            handoff.timer.cancel()
        for waiter in self._waiters.pop(ctx_request_id, ()):
            if not waiter.done():
                waiter.set_exception(_ContextFailed(reason))

    def _hand_to_waiter(self, handoff: Handoff) -> bool:
        for waiter in self._waiters.get(handoff.ctx_request_id, ()):
            if not waiter.done():
                waiter.set_result(handoff)
                return True
        return False

    def _hold(self, handoff: Handoff) -> None:
        previous = self._held.pop(handoff.ctx_request_id, None)
        if previous is not None:
            self._drop_expired(previous)
        loop = asyncio.get_running_loop()
        handoff.timer = loop.call_at(handoff.expires_at, self._expire, handoff)
        self._held[handoff.ctx_request_id] = handoff

    def _expire(self, handoff: Handoff) -> None:
        if self._held.get(handoff.ctx_request_id) is handoff:
            del self._held[handoff.ctx_request_id]
            self._drop_expired(handoff)

    def _drop_expired(self, handoff: Handoff) -> None:
        if handoff.timer is not None:
            handoff.timer.cancel()
        self.expired += 1
        reason = f"its KV cache expired after {self.kv_timeout:g}s without being taken"
        self._failures.remember(handoff.ctx_request_id, reason, self._now())

    # -- the generation side (called through /sim/kv/take) -----------------------------------

    def _taken(self, handoff: Handoff) -> TakeResult:
        if handoff.timer is not None:
            handoff.timer.cancel()
        self.taken += 1
        return TakeResult("taken", handoff=handoff)

    async def take(self, ctx_request_id: int, state: str | None, wait_s: float) -> TakeResult:
        """Takes the handoff of `ctx_request_id`; see the module docstring for the two ways."""
        if state is not None:
            return self._take_verified(ctx_request_id, state)
        handoff = self._held.pop(ctx_request_id, None)
        if handoff is not None:
            return self._taken(handoff)
        reason = self._failures.get(ctx_request_id, self._now())
        if reason is not None:
            return TakeResult("failed", reason)
        return await self._rendezvous(ctx_request_id, wait_s)

    def _take_verified(self, ctx_request_id: int, state: str) -> TakeResult:
        if not self.signer.verify(ctx_request_id, state):
            return TakeResult("not_issued", "its encoded_opaque_state does not verify")
        handoff = self._held.pop(ctx_request_id, None)
        if handoff is not None:
            return self._taken(handoff)
        reason = self._failures.get(ctx_request_id, self._now())
        return TakeResult("not_issued", reason or "it is not held (already taken or unknown)")

    async def _rendezvous(self, ctx_request_id: int, wait_s: float) -> TakeResult:
        if wait_s <= 0:
            return TakeResult("timeout", "the context phase has not finished")
        waiter: asyncio.Future[Handoff] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(ctx_request_id, [])
        waiters.append(waiter)
        try:
            async with asyncio.timeout(wait_s):
                handoff = await waiter
        except TimeoutError:
            # The handoff may have been handed over in the same instant the timer fired.
            delivered = _delivered(waiter)
            if delivered is None:
                return TakeResult(
                    "timeout", f"the context phase did not finish within {wait_s:g}s"
                )
            handoff = delivered
        except _ContextFailed as exc:
            return TakeResult("failed", str(exc))
        except asyncio.CancelledError:
            # The taker left after the handoff was handed over but before it resumed:
            # the KV is still here, so hold it for someone else rather than leak it.
            delivered = _delivered(waiter)
            if delivered is not None:
                self._hold(delivered)
            raise
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters and self._waiters.get(ctx_request_id) is waiters:
                del self._waiters[ctx_request_id]
        return self._taken(handoff)


def _delivered(waiter: asyncio.Future[Handoff]) -> Handoff | None:
    if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
        return waiter.result()
    return None


class _ContextFailed(Exception):
    """Set on a rendezvous waiter when the context phase it waits for fails."""
