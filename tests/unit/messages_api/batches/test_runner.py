"""The batch runner's pure pieces (messages_api/batches/runner.py): the backoff of an item refused
for load."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from messages_api.batches.runner import backoff


@given(st.integers(1, 60), st.one_of(st.none(), st.floats(0, 120)))
def test_backoff_grows_is_capped_and_honours_retry_after(attempt: int, retry_after: float | None) -> None:
    from django.conf import settings

    wait = backoff(attempt, retry_after)
    exponential = min(settings.BATCH_RETRY_MAX_S, settings.BATCH_RETRY_BASE_S * 2 ** (attempt - 1))
    assert max(retry_after or 0.0, exponential * 0.5) <= wait <= max(retry_after or 0.0, exponential)


def test_backoff_doubles_from_the_base(settings: Any) -> None:
    settings.BATCH_RETRY_BASE_S, settings.BATCH_RETRY_MAX_S = 1.0, 60.0
    assert 0.5 <= backoff(1, None) <= 1.0
    assert 4.0 <= backoff(4, None) <= 8.0
    assert 30.0 <= backoff(20, None) <= 60.0
    assert backoff(1, 30.0) == 30.0
