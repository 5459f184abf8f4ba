"""Reservations are released once; a second release is counted and exported, never applied."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

import workers.cluster.metrics  # noqa: F401  (registers the cluster collector)
from tests.support.cluster import reservations_closed
from workers.cluster.registry import EndpointInfo
from workers.routing.reservations import Reservation, ledger

pytestmark = pytest.mark.django_db(transaction=True)

ENDPOINT = EndpointInfo(id=991, pool_name="p", role="generation", url="http://w", enabled=True, draining=False, healthy=True)


def duplicates_metric() -> float:
    value = REGISTRY.get_sample_value("gateway_duplicate_releases_total")
    assert value is not None
    return value


def test_a_second_release_is_counted_and_exported(transactional_db: Any) -> None:
    before = duplicates_metric()
    reservation = Reservation.take("req_dup", ENDPOINT, "generation")
    assert ledger.open_count(ENDPOINT.id) == 1
    assert reservation.release("success") is True
    assert reservation.release("failure") is False
    assert (reservation.outcome, ledger.open_count(ENDPOINT.id)) == ("success", 0)
    assert duplicates_metric() == before + 1
    [row] = reservations_closed("req_dup")
    assert row.outcome == "success"
