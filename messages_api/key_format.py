"""The form of the API keys the gateway issues, which it can check without the database.

    sk-gw2-<43 random base62 characters><6 base62 characters of tag>

The random part is 256 bits (62**43 > 2**256). The tag is an HMAC-SHA256 of the prefix and the
random part under a secret of the deployment (`auth` derives it from SECRET_KEY), reduced to six
base62 characters (~35.7 bits): a key the gateway did not issue passes the check with a
probability of 1 in 56.8 billion, and nobody without the secret can make one that passes more
often. A public checksum (GitHub's CRC32 in `ghp_` tokens) would stop typos and lazy floods but not
a client who read this module; a keyed one stops both, at the same cost (one HMAC).

The tag is a filter, never a credential: a key whose tag checks is still looked up in the database
(revoked, deleted, or made by someone holding the secret: all refused there). A leaked secret only
brings back the database lookups this check saves.

Pure functions of their arguments (no settings, no database): the property tests in
tests/unit/messages_api/test_key_format.py check that every issued key passes and that changing any character
of one makes it fail.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

__all__ = [
    "ALPHABET",
    "derive_secret",
    "is_issued",
    "KEY_LENGTH",
    "KEY_PREFIX",
    "new_key",
    "RANDOM_LENGTH",
    "tag",
    "TAG_LENGTH",
]

KEY_PREFIX = "sk-gw2-"
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
RANDOM_LENGTH = 43
TAG_LENGTH = 6
KEY_LENGTH = len(KEY_PREFIX) + RANDOM_LENGTH + TAG_LENGTH
# What the tag's HMAC key is derived for, so that the secret it comes from serves nothing else here.
_PURPOSE = b"messages_api.key_format.tag"
_TAG_SPACE = len(ALPHABET) ** TAG_LENGTH


def derive_secret(secret: str) -> bytes:
    """The tag's HMAC key for a deployment secret (as Django's `salted_hmac` derives its keys)."""
    return hashlib.sha256(_PURPOSE + secret.encode()).digest()


def tag(random_part: str, secret: bytes) -> str:
    """The tag of a key with this random part under `secret` (from `derive_secret`)."""
    digest = hmac.new(secret, (KEY_PREFIX + random_part).encode("ascii"), hashlib.sha256).digest()
    value = int.from_bytes(digest[:8], "big") % _TAG_SPACE
    chars = []
    for _ in range(TAG_LENGTH):
        value, index = divmod(value, len(ALPHABET))
        chars.append(ALPHABET[index])
    return "".join(chars)


def new_key(secret: bytes) -> str:
    """A new key, tagged under `secret`."""
    random_part = "".join(secrets.choice(ALPHABET) for _ in range(RANDOM_LENGTH))
    return KEY_PREFIX + random_part + tag(random_part, secret)


def is_issued(key: str, secrets_: Sequence[bytes]) -> bool:
    """`key` has the issued form and its tag checks under one of `secrets_` (the current one first,
    then those kept while a rotation lasts)."""
    if len(key) != KEY_LENGTH or not key.startswith(KEY_PREFIX):
        return False
    body = key[len(KEY_PREFIX) :]
    if not (body.isascii() and body.isalnum()):
        return False
    random_part, presented = body[:RANDOM_LENGTH], body[RANDOM_LENGTH:]
    return any(hmac.compare_digest(tag(random_part, secret), presented) for secret in secrets_)
