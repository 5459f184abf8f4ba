"""The form of issued API keys (messages_api/key_format.py), as properties: every key issued under a
secret passes under it (and under a list holding it), and any change of one character, any cut or
addition, and any other secret make it fail."""

from __future__ import annotations

import string

from hypothesis import given
from hypothesis import strategies as st

from messages_api import key_format
from messages_api.key_format import ALPHABET, KEY_LENGTH, KEY_PREFIX, derive_secret, is_issued, new_key, tag

secrets_ = st.text(min_size=1, max_size=60).map(derive_secret)
randoms = st.text(alphabet=ALPHABET, min_size=key_format.RANDOM_LENGTH, max_size=key_format.RANDOM_LENGTH)
printable = st.sampled_from(string.printable.strip())


def key_of(random_part: str, secret: bytes) -> str:
    return KEY_PREFIX + random_part + tag(random_part, secret)


@given(secrets_)
def test_a_new_key_passes_under_its_secret(secret: bytes) -> None:
    key = new_key(secret)
    assert len(key) == KEY_LENGTH and key.startswith(KEY_PREFIX)
    assert set(key[len(KEY_PREFIX) :]) <= set(ALPHABET)
    assert is_issued(key, [secret])


@given(randoms, secrets_, secrets_)
def test_every_issued_key_passes_under_its_secret_among_others(random_part: str, secret: bytes, other: bytes) -> None:
    key = key_of(random_part, secret)
    assert is_issued(key, [secret]) and is_issued(key, [other, secret]) and is_issued(key, [secret, other])


@given(randoms, secrets_, st.data())
def test_changing_any_one_character_fails(random_part: str, secret: bytes, data: st.DataObject) -> None:
    key = key_of(random_part, secret)
    position = data.draw(st.integers(0, len(key) - 1))
    replacement = data.draw(printable.filter(lambda c: c != key[position]))
    mutated = key[:position] + replacement + key[position + 1 :]
    # A changed random part needs its 6-character tag to collide (1 in 62**6); none is seen.
    assert not is_issued(mutated, [secret])


@given(randoms, secrets_, st.data())
def test_swapping_two_characters_fails(random_part: str, secret: bytes, data: st.DataObject) -> None:
    key = key_of(random_part, secret)
    i = data.draw(st.integers(len(KEY_PREFIX), len(key) - 2))
    j = data.draw(st.integers(i + 1, len(key) - 1).filter(lambda j: key[j] != key[i]))
    swapped = key[:i] + key[j] + key[i + 1 : j] + key[i] + key[j + 1 :]
    assert not is_issued(swapped, [secret])


@given(randoms, secrets_, st.text(alphabet=ALPHABET, min_size=1, max_size=8), st.integers(1, 10))
def test_cut_or_extended_keys_fail(random_part: str, secret: bytes, extra: str, cut: int) -> None:
    key = key_of(random_part, secret)
    assert not is_issued(key + extra, [secret])
    assert not is_issued(key[:-cut], [secret])
    assert not is_issued(extra + key, [secret])


@given(randoms, secrets_, secrets_)
def test_another_secret_fails(random_part: str, secret: bytes, other: bytes) -> None:
    if other != secret:
        assert not is_issued(key_of(random_part, secret), [other])
    assert not is_issued(key_of(random_part, secret), [])


@given(st.text(max_size=80))
def test_arbitrary_text_fails(text: str) -> None:
    assert not is_issued(text, [derive_secret("s")])


def test_random_keys_of_the_issued_shape_pass_about_once_in_62_to_the_6() -> None:
    """The rate a client without the secret can hit: 20,000 random tags, none passes."""
    secret = derive_secret("s")
    random_part = new_key(secret)[len(KEY_PREFIX) : -key_format.TAG_LENGTH]
    right = tag(random_part, secret)
    tags = {new_key(derive_secret(str(i)))[-key_format.TAG_LENGTH :] for i in range(20_000)}
    assert sum(is_issued(KEY_PREFIX + random_part + t, [secret]) for t in tags) == (1 if right in tags else 0)
