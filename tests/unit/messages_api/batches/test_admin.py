"""The admin's batches page: owner, progress by state, age, expiry, the link to the items' audit
rows, and the cancel action (messages_api/batches/admin.py)."""

from __future__ import annotations

import orjson
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from messages_api.auth import create_api_key
from messages_api.batches import store
from messages_api.batches.schema import ItemSpec
from messages_api.models import MessageBatch, MessageRequest

pytestmark = pytest.mark.django_db


def client_with(*codenames: str, superuser: bool = False) -> Client:
    user = get_user_model().objects.create_user("op", password="x", is_staff=True, is_superuser=superuser)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def test_the_batches_page_and_its_cancel_action() -> None:
    key, _ = create_api_key("batch-owner")
    batch = store.create_batch(key.pk, key.name, [ItemSpec(f"i{n}", orjson.dumps({"n": n})) for n in range(4)])
    (item,) = store.claim("host:1:x", 1, 60)
    store.finish("host:1:x", item, "succeeded", "{}", "req_1")
    store.claim("host:1:x", 1, 60)
    client = client_with(superuser=True)
    page = client.get(reverse("admin:messages_api_messagebatch_changelist")).content.decode()
    assert batch.batch_id in page and "batch-owner" in page
    assert ">queued 2<" in page and ">running 1<" in page and ">succeeded 1<" in page
    assert f"?batch_id={batch.batch_id}" in page
    answer = client.post(
        reverse("admin:messages_api_messagebatch_changelist"),
        {"action": "cancel_batches", "_selected_action": [MessageBatch.objects.get().pk]},
        follow=True,
    )
    assert "Cancellation started for 1 batch(es)." in answer.content.decode()
    assert MessageBatch.objects.get().processing_status == "canceling"  # one item still running
    MessageRequest.objects.create(request_id="req_1", received_at=MessageBatch.objects.get().created_at, batch_id=batch.batch_id, custom_id="i0")
    audit = client.get(reverse("admin:messages_api_messagerequest_changelist") + f"?batch_id={batch.batch_id}")
    assert audit.status_code == 200 and "req_1" in audit.content.decode()


def test_cancel_needs_the_change_permission() -> None:
    key, _ = create_api_key("batch-owner")
    store.create_batch(key.pk, key.name, [ItemSpec("a", b"{}")])
    reader = client_with("view_messagebatch", "view_messagerequest")
    page = reader.get(reverse("admin:messages_api_messagebatch_changelist")).content.decode()
    assert "cancel_batches" not in page


def test_the_overview_counts_batches_in_progress_and_their_items() -> None:
    from messages_api.overview import batch_figure

    key, _ = create_api_key("batch-owner")
    store.create_batch(key.pk, key.name, [ItemSpec(f"i{n}", b"{}") for n in range(3)])
    store.claim("host:1:x", 1, 60)
    assert batch_figure() == ("batches in progress", "1", "2 items waiting, 1 running")
    page = client_with(superuser=True).get(reverse("admin:cluster_overview_live")).content.decode()
    assert "batches in progress" in page and "2 items waiting, 1 running" in page
