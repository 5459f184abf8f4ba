"""API keys: generation, hashing, reading a request's credentials, and a per-process cache so that
authenticating a request does not query the database.

Keys are random 256-bit secrets, so one unsalted SHA-256 is the right hash: there is nothing to
brute-force, and it keeps the lookup a single indexed equality (Django's password hashers are for
low-entropy passwords and cost tens of milliseconds by design).

Only keys the gateway issued reach the database. Keys are issued in a form it checks alone
(messages_api/key_format.py: `sk-gw2-`, a tag keyed by SECRET_KEY, or one of SECRET_KEY_FALLBACKS
while a rotation lasts). Keys issued before that form (`sk-gw-`, untagged) stay valid: their
hashes, a finite set that no longer grows, are loaded from the database (`LegacyKeys`), so any other
key is refused without a query, whatever it looks like. The lookups that remain run at most
GATEWAY_KEY_LOOKUP_CONCURRENCY at a time; one that waits GATEWAY_KEY_LOOKUP_WAIT_S for its turn
fails with 529 overloaded_error (`KeyLookupOverloaded`).

Under daphne the key is checked while the request's headers are parsed, before its body is read
(messages_api/server/header_gate.py); the consumer checks it again (a dictionary lookup then).
"""

from __future__ import annotations

import asyncio
import base64
import enum
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from functools import lru_cache

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from prometheus_client import Counter

from messages_api import key_format
from messages_api.errors import AnthropicError
from messages_api.limits.policy import NO_LIMITS, KeyLimits
from messages_api.models import ApiKey
from workers import Priority

logger = logging.getLogger(__name__)

# The prefix of the keys issued now (`ApiKey.prefix` keeps it and the next 6 characters), and of
# those issued before keys carried a tag (`LegacyKeys`).
KEY_PREFIX = key_format.KEY_PREFIX
LEGACY_KEY_PREFIX = "sk-gw-"
# How long a looked-up key (or a miss) is trusted before the database is asked again: revoking
# a key in the admin takes effect within this time in every process.
CACHE_TTL_S = 5.0
MISS_TTL_S = 1.0
# Keys found not to exist, kept apart from the valid ones: at most this many, least recently seen
# dropped first, so a flood of random keys can evict only other misses, never a valid key.
MISSES_KEPT = 10_000
# No key of ours is longer, and none has a character outside printable ASCII: such a credential is
# refused without a database lookup.
MAX_KEY_LENGTH = 256

MISSING_KEY = "x-api-key header is required"
INVALID_KEY = "invalid x-api-key"
LOOKUP_OVERLOADED = "The gateway is busy checking API keys: retry shortly"
# A key in use is looked up again in the background once its entry has less than this left.
REFRESH_AHEAD_S = 1.0
# last_used_at is bookkeeping: write it at most this often per key.
LAST_USED_RESOLUTION_S = 60.0


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated key: who it is, and what it may do."""

    key_hash: str
    name: str
    key_id: int = 0
    limits: KeyLimits = NO_LIMITS
    #: The key's class in the admission queue.
    priority: Priority = Priority.STANDARD
    #: Model names or fnmatch patterns the key may use; empty: any.
    allowed_models: tuple[str, ...] = ()
    #: The key's prefix-cache namespace (`cache_salt`): the workers' caches keep it apart from
    #: other keys' where the pool says so. Kept out of repr (and so out of logs).
    cache_salt: str = field(default="", repr=False)

    def may_use(self, model: str) -> bool:
        return not self.allowed_models or any(fnmatchcase(model, pattern) for pattern in self.allowed_models)


def cache_salt(key_id: int, cache_group: str = "") -> str:
    """The prefix-cache salt of a key: the same for every key of a cache group, else the key's
    own. An HMAC of the key's id (or group name) under SECRET_KEY, never of its secret, so a
    worker's logs tell nothing of the key; 256 bits in unpadded base64url (43 characters), as vLLM
    asks of a salt. Stable across processes and restarts; rotating SECRET_KEY starts every
    cache afresh."""
    scope = f"group:{cache_group}" if cache_group else f"key:{key_id}"
    digest = hmac.new(settings.SECRET_KEY.encode(), b"prefix-cache-salt:" + scope.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def generate_key() -> str:
    """A new key in the issued form, tagged under SECRET_KEY."""
    return key_format.new_key(tag_secrets()[0])


def tag_secrets() -> tuple[bytes, ...]:
    """The HMAC keys an issued key's tag is checked under: SECRET_KEY's, then each of
    SECRET_KEY_FALLBACKS' (Django's list of the secrets a rotation keeps accepting)."""
    return _derived(settings.SECRET_KEY, tuple(getattr(settings, "SECRET_KEY_FALLBACKS", ())))


@lru_cache(maxsize=4)
def _derived(secret: str, fallbacks: tuple[str, ...]) -> tuple[bytes, ...]:
    return tuple(key_format.derive_secret(s) for s in (secret, *fallbacks))


def is_issued(key: str) -> bool:
    """`key` has the form of a key this deployment issued (its tag checks): it is worth a lookup."""
    return key_format.is_issued(key, tag_secrets())


class KeyLookupOverloaded(AnthropicError):
    """A lookup that waited GATEWAY_KEY_LOOKUP_WAIT_S for one of the GATEWAY_KEY_LOOKUP_CONCURRENCY
    turns and got none: answered 529 overloaded_error (the SDKs retry it after a backoff)."""

    def __init__(self) -> None:
        super().__init__(529, LOOKUP_OVERLOADED, "overloaded_error", retry_after=1.0)


lookups_overloaded = Counter(
    "gateway_key_lookups_overloaded",
    "API key lookups refused with 529: they waited GATEWAY_KEY_LOOKUP_WAIT_S for a turn (GATEWAY_KEY_LOOKUP_CONCURRENCY).",
)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def shown_prefix(key: str) -> str:
    """What `ApiKey.prefix` keeps of a key to tell it apart: its prefix and 6 more characters."""
    return key[: len(KEY_PREFIX) + 6]


def create_api_key(name: str, *, cache_group: str = "") -> tuple[ApiKey, str]:
    """Create a key (in the issued form); the plain key is returned once and never stored."""
    key = generate_key()
    api_key = ApiKey.objects.create(name=name, key_hash=hash_key(key), prefix=shown_prefix(key), cache_group=cache_group)
    return api_key, key


class CredentialError(ValueError):
    """Credentials that cannot be used as they are (answered 401 with this message)."""


def key_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The API key of a request's header list (an ASGI scope's `headers`): see `key_from_values`."""
    api_keys: list[bytes] = []
    authorizations: list[bytes] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"x-api-key":
            api_keys.append(value)
        elif lowered == b"authorization":
            authorizations.append(value)
    return key_from_values(api_keys, authorizations)


def key_from_values(api_keys: Sequence[bytes], authorizations: Sequence[bytes]) -> str | None:
    """The key of a request with these `x-api-key` and `Authorization` header values: the SDKs send
    one or the other, or both with the same key. None when there is none; `CredentialError` when
    they are ambiguous (two of a header, or two different keys: which one would be charged?) or
    cannot be a key (not printable ASCII, or too long)."""
    if len(api_keys) > 1:
        raise CredentialError("The request has more than one x-api-key header: send one")
    if len(authorizations) > 1:
        raise CredentialError("The request has more than one Authorization header: send one")
    key = api_keys[0].strip(b" \t") if api_keys else b""
    bearer = b""
    if authorizations:
        scheme, _, value = authorizations[0].strip(b" \t").partition(b" ")
        if scheme.lower() == b"bearer":
            bearer = value.strip(b" \t")
    if key and bearer and key != bearer:
        raise CredentialError("x-api-key and Authorization: Bearer carry different keys: send one")
    chosen = key or bearer
    if not chosen:
        return None
    if len(chosen) > MAX_KEY_LENGTH or not chosen.isascii() or not chosen.decode("ascii").isprintable():
        raise CredentialError(INVALID_KEY)
    return chosen.decode("ascii")


class NotCached(enum.Enum):
    """What `KeyCache.peek` says of a key only the database can tell about."""

    NOT_CACHED = "not cached"


NOT_CACHED = NotCached.NOT_CACHED


class LegacyKeys:
    """The hashes of the active keys issued before keys carried a tag (`ApiKey.prefix` not of the
    issued form), so that an untagged key is looked up only when it is one of them.

    The set is finite and no longer grows (every key issued now is tagged): it is loaded once
    (the first untagged key waits for that one query), then again in the background every
    GATEWAY_LEGACY_KEYS_REFRESH_S while untagged keys keep arriving, the old set answering
    meanwhile. A legacy key deactivated since is still looked up until then (and refused by its
    lookup); one reactivated is refused until then. Once a deployment has rotated its last legacy
    key, an untagged key costs a set lookup and nothing else."""

    # After a failed load, the next try waits this long (the database is down or slow: a flood of
    # untagged keys must not become a flood of loads).
    RETRY_S = 5.0

    def __init__(self) -> None:
        self._hashes: frozenset[str] | None = None
        self._next_load_at = 0.0
        self._loading: asyncio.Future[frozenset[str]] | None = None

    def holds(self, digest: str, now: float) -> bool | None:
        """Whether `digest` is a legacy key's: None until the set is first loaded (`load`)."""
        if now >= self._next_load_at and self._hashes is not None:
            try:
                self.load()  # in the background: the current set answers meanwhile
            except RuntimeError:
                pass  # no event loop running (a synchronous caller): the next one reloads it
        return None if self._hashes is None else digest in self._hashes

    def load(self) -> asyncio.Future[frozenset[str]]:
        """The set's load in flight, started if there is none and the last one is due again
        (RuntimeError without a running event loop)."""
        loop = asyncio.get_running_loop()
        loading = self._loading
        if loading is not None and loading.get_loop() is loop and not loading.done():
            return loading
        if self._hashes is not None and time.monotonic() < self._next_load_at:
            done: asyncio.Future[frozenset[str]] = loop.create_future()
            done.set_result(self._hashes)
            return done
        loading = self._loading = asyncio.ensure_future(self._load())
        return loading

    async def _load(self) -> frozenset[str]:
        try:
            hashes = await sync_to_async(_legacy_hashes, thread_sensitive=False)()
        except Exception:
            self._next_load_at = time.monotonic() + self.RETRY_S
            if self._hashes is None:
                raise
            logger.warning("Could not reload the legacy API keys: the last set answers meanwhile", exc_info=True)
            return self._hashes
        self._hashes = hashes
        self._next_load_at = time.monotonic() + settings.GATEWAY_LEGACY_KEYS_REFRESH_S
        return hashes

    def clear(self) -> None:
        self._hashes = None
        self._next_load_at = 0.0
        self._loading = None


class KeyCache:
    """Looked-up keys (and misses) for a few seconds, one lookup at a time per key.

    A key the gateway did not issue (`is_issued` false, and not one of the `LegacyKeys`) is refused
    here without a lookup and without an entry: random and malformed keys cost a hash, at most one
    HMAC and a set lookup, and hold no memory.

    A burst of requests with a key whose entry has expired shares one database lookup instead of
    each sending its own (a thousand concurrent lookups once took half of the process's CPU and
    held every request's start behind them), and a key in use is looked up again shortly before
    its entry expires, in the background, so its requests do not wait for the database at all.
    Lookups of different keys run at most GATEWAY_KEY_LOOKUP_CONCURRENCY at a time; a lookup that
    waits GATEWAY_KEY_LOOKUP_WAIT_S for its turn fails with `KeyLookupOverloaded` (not cached).

    Valid keys and misses are kept apart: the valid ones are as many as the database holds; the
    misses (revoked or deleted keys, which only their holders can send) are an LRU of at most
    `misses_kept`, which only other misses can push out.
    """

    def __init__(self, misses_kept: int = MISSES_KEPT) -> None:
        self._known: dict[str, tuple[Principal, float]] = {}  # digest → (principal, expiry)
        self._misses: OrderedDict[str, float] = OrderedDict()  # digest → expiry, least recent first
        self._misses_kept = misses_kept
        self._lookups: dict[str, asyncio.Future[Principal | None]] = {}
        self._last_used_written: dict[str, float] = {}
        self._legacy = LegacyKeys()
        self._turns: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def peek(self, key: str) -> Principal | None | NotCached:
        """What the cache knows of `key` now, without waiting: its principal, None for a key known
        not to be valid (or not one the gateway issued), NOT_CACHED when only the database can tell
        (`lookup`)."""
        return self._peek(key, hash_key(key), time.monotonic())

    def lookup(self, key: str) -> asyncio.Future[Principal | None]:
        """The database lookup of `key` (shared with any already in flight); its answer is cached.
        A key the gateway did not issue is answered None at once."""
        digest = hash_key(key)
        if self._admissible(key, digest, time.monotonic()) is False:
            refused: asyncio.Future[Principal | None] = asyncio.get_running_loop().create_future()
            refused.set_result(None)
            return refused
        return self._shared_lookup(key, digest)

    def known(self, key: str) -> bool:
        """`key` was found valid in this process and not found invalid since, however long ago
        (its entry may need a lookup again): a finite set, bounded by the database's keys."""
        return hash_key(key) in self._known

    async def authenticate(self, key: str) -> Principal | None:
        return await self._authenticate(key, hash_key(key))

    async def authenticate_hash(self, digest: str) -> Principal | None:
        """`authenticate` for a key known by its hash from the gateway's own rows (a Message Batch's
        owner, whose items run without the key's request): no form to check, only the row."""
        return await self._authenticate(None, digest)

    async def _authenticate(self, key: str | None, digest: str) -> Principal | None:
        now = time.monotonic()
        cached = self._peek(key, digest, now)
        if cached is NOT_CACHED:
            # Shielded: one waiter's cancellation (its client left) must not fail the others.
            principal = await asyncio.shield(self._shared_lookup(key, digest))
        else:
            principal = cached
            if principal is not None and self._known[digest][1] - now < REFRESH_AHEAD_S:
                self._shared_lookup(key, digest)  # fire and forget: the entry stays valid meanwhile
        if principal is not None:
            self._touch(principal, now)
        return principal

    def _peek(self, key: str | None, digest: str, now: float) -> Principal | None | NotCached:
        known = self._known.get(digest)
        if known is not None and known[1] > now:
            return known[0]
        missed = self._misses.get(digest)
        if missed is not None and missed > now:
            self._misses.move_to_end(digest)
            return None
        if self._admissible(key, digest, now) is False:
            return None
        return NOT_CACHED

    def _admissible(self, key: str | None, digest: str, now: float) -> bool | None:
        """Worth a lookup: issued (its tag checks) or a legacy key's, or a hash from the gateway's
        own rows (`key` None); None while the legacy keys are not loaded yet (the lookup waits for
        them)."""
        if key is None or is_issued(key):
            return True
        return self._legacy.holds(digest, now)

    def _shared_lookup(self, key: str | None, digest: str) -> asyncio.Future[Principal | None]:
        """The lookup of `digest` in flight, started if there is none."""
        lookup = self._lookups.get(digest)
        if lookup is None or lookup.get_loop() is not asyncio.get_running_loop():
            lookup = self._lookups[digest] = asyncio.ensure_future(self._fetch(key, digest))
            lookup.add_done_callback(_log_failure)
        return lookup

    async def _fetch(self, key: str | None, digest: str) -> Principal | None:
        try:
            if key is not None and not is_issued(key) and digest not in await self._legacy.load():
                return None  # not a key of ours after all: nothing to cache
            principal = await self._query(digest)
        finally:
            self._lookups.pop(digest, None)
        self._store(digest, principal)
        return principal

    async def _query(self, digest: str) -> Principal | None:
        """`_lookup` on a thread, in one of the lookup turns."""
        loop = asyncio.get_running_loop()
        if self._turns is None or self._turns[0] is not loop:
            self._turns = (loop, asyncio.Semaphore(max(1, settings.GATEWAY_KEY_LOOKUP_CONCURRENCY)))
        turns = self._turns[1]
        try:
            async with asyncio.timeout(settings.GATEWAY_KEY_LOOKUP_WAIT_S):
                await turns.acquire()
        except TimeoutError:
            lookups_overloaded.inc()
            raise KeyLookupOverloaded() from None
        try:
            return await sync_to_async(_lookup, thread_sensitive=False)(digest)
        finally:
            turns.release()

    def _store(self, digest: str, principal: Principal | None) -> None:
        now = time.monotonic()
        if principal is not None:
            self._misses.pop(digest, None)
            self._known[digest] = (principal, now + CACHE_TTL_S)
            return
        self._known.pop(digest, None)  # revoked or deleted since it was cached
        self._misses[digest] = now + MISS_TTL_S
        self._misses.move_to_end(digest)
        while len(self._misses) > self._misses_kept:
            self._misses.popitem(last=False)

    def _touch(self, principal: Principal, now: float) -> None:
        if now - self._last_used_written.get(principal.key_hash, -LAST_USED_RESOLUTION_S) < LAST_USED_RESOLUTION_S:
            return
        self._last_used_written[principal.key_hash] = now
        # Fire and forget on the default executor: bookkeeping must not delay the request.
        asyncio.get_running_loop().run_in_executor(None, _touch_last_used, principal.key_hash)

    def clear(self) -> None:
        self._known.clear()
        self._misses.clear()
        self._legacy.clear()


def _log_failure(lookup: asyncio.Future[Principal | None]) -> None:
    # A background refresh has no waiter to raise into; its waiters (if any) see the error too.
    # An overloaded lookup is counted (gateway_key_lookups_overloaded_total), not logged: under
    # the load that causes it, a line each would add to it.
    if lookup.cancelled():
        return
    exc = lookup.exception()
    if exc is not None and not isinstance(exc, KeyLookupOverloaded):
        logger.error("API key lookup failed", exc_info=exc)


def _legacy_hashes() -> frozenset[str]:
    try:
        legacy = ApiKey.objects.filter(active=True).exclude(prefix__startswith=KEY_PREFIX).order_by()
        return frozenset(legacy.values_list("key_hash", flat=True))
    finally:
        close_old_connections()


def _touch_last_used(digest: str) -> None:
    try:
        ApiKey.objects.filter(key_hash=digest).update(last_used_at=datetime.now(timezone.utc))
    finally:
        close_old_connections()


_PRINCIPAL_FIELDS = (
    "id", "name", "priority", "allowed_models", "max_concurrency", "requests_per_minute", "input_tokens_per_minute",
    "output_tokens_per_minute", "tokens_per_day", "tokens_per_month", "cache_group",
)


def _lookup(digest: str) -> Principal | None:
    try:
        row = ApiKey.objects.filter(key_hash=digest, active=True).values(*_PRINCIPAL_FIELDS).first()
    finally:
        close_old_connections()
    if row is None:
        return None
    return Principal(
        key_hash=digest,
        name=row["name"],
        key_id=row["id"],
        limits=KeyLimits(
            concurrency=row["max_concurrency"],
            requests_per_minute=row["requests_per_minute"],
            input_tokens_per_minute=row["input_tokens_per_minute"],
            output_tokens_per_minute=row["output_tokens_per_minute"],
            tokens_per_day=row["tokens_per_day"],
            tokens_per_month=row["tokens_per_month"],
        ),
        priority=Priority.from_label(row["priority"]),
        allowed_models=tuple(m for m in row["allowed_models"] or () if isinstance(m, str)),
        cache_salt=cache_salt(row["id"], row["cache_group"]),
    )


key_cache = KeyCache()
