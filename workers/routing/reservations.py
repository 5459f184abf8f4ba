"""Reservations: capacity held on an endpoint for one stage of one request.

A reservation is taken before its worker is called and released exactly once, whichever path
ends the request; `release` is idempotent and a second call is counted, not applied. The open
count per endpoint lives in memory (routing reads it on every request); the row is written through
the background writer so operators and crash recovery can see it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone

from disagg_project import GATEWAY_INSTANCE, get_writer, new_id
from workers.admission import capacity
from workers.admission.headroom import activity
from workers.admission.queue import notify_freed
from workers.cluster.registry import EndpointInfo
from workers.models import Outcome
from workers.models import Reservation as ReservationRow


class ReservationLedger:
    """Open reservations of this process, by endpoint."""

    def __init__(self) -> None:
        self.open_by_endpoint: Counter[int] = Counter()
        # Tokens (prompt + max_tokens) of the open reservations, by endpoint: for capacity_tokens.
        self.tokens_by_endpoint: Counter[int] = Counter()
        # Releases of an already released reservation (exported as a metric; should stay 0).
        self.duplicate_releases = 0

    def open_count(self, endpoint_id: int) -> int:
        return self.open_by_endpoint.get(endpoint_id, 0)

    def tokens(self, endpoint_id: int) -> int:
        return self.tokens_by_endpoint.get(endpoint_id, 0)


ledger = ReservationLedger()
# `Outcome.values` builds its list on every access.
_OUTCOMES = frozenset(Outcome.values)


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(slots=True, eq=False)
class Reservation:
    request_id: str
    endpoint: EndpointInfo
    stage: str
    reservation_id: str = field(default_factory=new_id)
    reserved_at: datetime = field(default_factory=_now)
    released_at: datetime | None = None
    outcome: str = ""
    #: Tokens it holds of the endpoint's capacity_tokens (0 on an endpoint without one).
    tokens: int = 0
    #: Whose slot it is (the admission ticket's flow: the API key), for the pool's headroom.
    flow: str = ""

    @classmethod
    def take(
        cls, request_id: str, endpoint: EndpointInfo, stage: str, *, tokens: int = 0, reservation_id: str | None = None, flow: str = ""
    ) -> Reservation:
        """Hold the endpoint (for a capped one, `reservation_id` names the slot `workers.admission`
        acquired for it, and `flow` whose slot it is)."""
        reservation = cls(request_id=request_id, endpoint=endpoint, stage=stage, tokens=tokens, flow=flow)
        if reservation_id is not None:
            reservation.reservation_id = reservation_id
        ledger.open_by_endpoint[endpoint.id] += 1
        if tokens:
            ledger.tokens_by_endpoint[endpoint.id] += tokens
        if endpoint.capped:
            activity.took((endpoint.pool_name, stage), flow)
        reservation._persist()
        return reservation

    def release(self, outcome: str) -> bool:
        """Release once; returns False (and counts it) if it was already released."""
        if self.released_at is not None:
            ledger.duplicate_releases += 1
            return False
        assert outcome in _OUTCOMES, outcome
        self.released_at = _now()
        self.outcome = outcome
        endpoint = self.endpoint
        ledger.open_by_endpoint[endpoint.id] -= 1
        if ledger.open_by_endpoint[endpoint.id] <= 0:
            del ledger.open_by_endpoint[endpoint.id]
        if self.tokens:
            ledger.tokens_by_endpoint[endpoint.id] -= self.tokens
            if ledger.tokens_by_endpoint[endpoint.id] <= 0:
                del ledger.tokens_by_endpoint[endpoint.id]
        if endpoint.capped:
            capacity.release(endpoint, self.reservation_id)
            activity.released((endpoint.pool_name, self.stage), self.flow)
            notify_freed((endpoint.pool_name, self.stage))
        self._persist()
        return True

    def _persist(self) -> None:
        get_writer().upsert(
            ReservationRow,
            "reservation_id",
            {
                "reservation_id": self.reservation_id,
                "request_id": self.request_id,
                "endpoint_id": self.endpoint.id,
                "endpoint_url": self.endpoint.url,
                "pool_name": self.endpoint.pool_name,
                "stage": self.stage,
                "gateway_instance": GATEWAY_INSTANCE,
                "reserved_at": self.reserved_at,
                "released_at": self.released_at,
                "outcome": self.outcome,
            },
        )
