"""Secrets never come back out of the admin: a pool's handoff signing key and an API key's hash are
not rendered to anyone (view-only staff included), and no changelist filters on them, which would
otherwise tell a secret one character at a time by the result count (`?handoff_signing_key__startswith=a`,
`b`, … until one row comes back)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from messages_api.models import ApiKey
from workers.models import ModelRoute, ModelRoutePool, Reservation, WorkerEndpoint, WorkerPool

SIGNING_KEY = "sk-handoff-9f8e7d6c5b4a39281706"
KEY_HASH = "ab" * 32

pytestmark = pytest.mark.django_db


@pytest.fixture
def pool(db: Any) -> WorkerPool:
    pool = WorkerPool.objects.create(name="secret-pool", model="m", handoff_signing_key=SIGNING_KEY)
    endpoint = WorkerEndpoint.objects.create(pool=pool, role="context", url="http://10.0.0.1:8001")
    Reservation.objects.create(
        reservation_id="r1", request_id="req_1", endpoint=endpoint, endpoint_url=endpoint.url, pool_name=pool.name,
        stage="context", reserved_at="2026-12-05T00:00:00Z",
    )  # fmt: skip
    route = ModelRoute.objects.create(name="claude-x")
    ModelRoutePool.objects.create(route=route, pool=pool, position=0)
    return pool


@pytest.fixture
def api_key(db: Any) -> ApiKey:
    return ApiKey.objects.create(name="tenant", key_hash=KEY_HASH, prefix="sk-gw-abcdef")


def client_with(*codenames: str, superuser: bool = False) -> Client:
    users = get_user_model().objects
    if superuser:
        user = users.create_superuser("root", "root@example.com", "pw")
    else:
        user = users.create_user("viewer", "viewer@example.com", "pw", is_staff=True)
        user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def test_view_only_staff_never_see_the_signing_key(pool: WorkerPool) -> None:
    viewer = client_with("view_workerpool", "view_workerendpoint")
    page = viewer.get(reverse("admin:workers_workerpool_change", args=[pool.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert SIGNING_KEY not in html
    assert "secret-pool" in html  # the page itself was rendered
    # Said to be set, never shown.
    assert "signing key set" in html.lower()


def test_editors_never_see_the_signing_key_either(pool: WorkerPool) -> None:
    root = client_with(superuser=True)
    for url in (
        reverse("admin:workers_workerpool_change", args=[pool.pk]),
        reverse("admin:workers_workerpool_changelist"),
        reverse("admin:workers_workerpool_history", args=[pool.pk]),
        reverse("admin:cluster_overview"),
        reverse("admin:cluster_overview_live"),
    ):
        page = root.get(url)
        assert page.status_code == 200, url
        assert SIGNING_KEY not in page.content.decode(), url


def test_nobody_sees_an_api_keys_hash(api_key: ApiKey) -> None:
    for client in (client_with("view_apikey"), client_with(superuser=True)):
        for url in (reverse("admin:messages_api_apikey_change", args=[api_key.pk]), reverse("admin:messages_api_apikey_changelist")):
            page = client.get(url)
            assert page.status_code == 200, url
            assert KEY_HASH not in page.content.decode(), url


SECRET_FILTERS = [
    ("admin:workers_workerpool_changelist", "handoff_signing_key__startswith"),
    ("admin:workers_workerpool_changelist", "handoff_signing_key"),
    ("admin:workers_workerpool_changelist", "handoff_signing_key__regex"),
    ("admin:workers_workerpool_changelist", "handoff_signing_key__gt"),
    ("admin:workers_workerendpoint_changelist", "pool__handoff_signing_key__startswith"),
    ("admin:workers_reservation_changelist", "endpoint__pool__handoff_signing_key__startswith"),
    ("admin:workers_modelroute_changelist", "pools__handoff_signing_key__startswith"),
    ("admin:workers_modelroute_changelist", "route_pools__pool__handoff_signing_key__startswith"),
    ("admin:messages_api_apikey_changelist", "key_hash__startswith"),
    ("admin:messages_api_apikey_changelist", "key_hash"),
    ("admin:messages_api_apikey_changelist", "usage__api_key__key_hash__startswith"),
]


@pytest.mark.parametrize(("changelist", "lookup"), SECRET_FILTERS)
def test_changelists_refuse_filters_on_secrets(pool: WorkerPool, api_key: ApiKey, changelist: str, lookup: str) -> None:
    """Refused (400) whatever the guess: a right and a wrong prefix get the same answer."""
    root = client_with(superuser=True)
    right = (SIGNING_KEY if "signing" in lookup else KEY_HASH)[:3]
    answers = {guess: root.get(reverse(changelist), {lookup: guess}) for guess in (right, "zzz")}
    assert {guess: r.status_code for guess, r in answers.items()} == {right: 400, "zzz": 400}


def test_other_filters_still_work(pool: WorkerPool, api_key: ApiKey) -> None:
    root = client_with(superuser=True)
    for changelist, query in (
        ("admin:workers_workerpool_changelist", {"protocol__exact": "trtllm"}),
        ("admin:workers_workerendpoint_changelist", {"pool__id__exact": str(pool.pk)}),
        ("admin:workers_reservation_changelist", {"pool_name": "secret-pool"}),
        ("admin:messages_api_apikey_changelist", {"active__exact": "1"}),
        ("admin:messages_api_messagerequest_changelist", {"status__exact": "failed"}),
    ):
        response = root.get(reverse(changelist), query)
        assert response.status_code == 200, (changelist, query)
