"""Users and groups in the admin are managed by superusers only (disagg_project/admin.py): a staff
user holding every auth permission still cannot make itself a superuser, reset a superuser's
password, or put itself in a group. And changes made through the admin are in its history."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.test import Client

from messages_api.auth import create_api_key

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN = "/" + settings.ADMIN_URL


@pytest.fixture
def staff() -> Any:
    """A staff user with every permission on users and groups, but not a superuser."""
    user = get_user_model().objects.create_user("helper", password="helper-password-1", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="auth", content_type__model__in=["user", "group"]))
    return user


@pytest.fixture
def root() -> Any:
    return get_user_model().objects.create_superuser("root", "", "root-password-1")


def client_for(user: Any) -> Client:
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)
    return client


def user_form(user: Any, **changes: Any) -> dict[str, Any]:
    data = {
        "username": user.username, "first_name": "", "last_name": "", "email": "", "is_active": "on",
        "is_staff": "on" if user.is_staff else "", "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00",
        "initial-date_joined_0": "2026-01-01", "initial-date_joined_1": "00:00:00",
    }  # fmt: skip
    data.update(changes)
    return {k: v for k, v in data.items() if v != ""}


def test_staff_cannot_make_itself_superuser(staff: Any) -> None:
    client = client_for(staff)
    response = client.post(f"{ADMIN}auth/user/{staff.pk}/change/", user_form(staff, is_superuser="on"))
    assert response.status_code == 403
    staff.refresh_from_db()
    assert not staff.is_superuser
    # The list and a user's page may still be looked at (view permission), read-only.
    assert client.get(f"{ADMIN}auth/user/").status_code == 200
    page = client.get(f"{ADMIN}auth/user/{staff.pk}/change/")
    assert page.status_code == 200 and b'name="is_superuser"' not in page.content


def test_staff_cannot_reset_a_superusers_password_add_users_or_touch_groups(staff: Any, root: Any) -> None:
    client = client_for(staff)
    password_url = f"{ADMIN}auth/user/{root.pk}/password/"
    response = client.post(password_url, {"password1": "taken-over-1!x", "password2": "taken-over-1!x", "usable_password": "true"})
    assert response.status_code == 403
    root.refresh_from_db()
    assert root.check_password("root-password-1")
    assert client.post(f"{ADMIN}auth/user/add/", {"username": "another", "password1": "x-Y-z-12345!", "password2": "x-Y-z-12345!"}).status_code == 403
    assert not get_user_model().objects.filter(username="another").exists()
    everything = Permission.objects.values_list("pk", flat=True)
    response = client.post(f"{ADMIN}auth/group/add/", {"name": "all", "permissions": list(everything)})
    assert response.status_code == 403
    assert not Group.objects.exists()
    assert client.post(f"{ADMIN}auth/user/{root.pk}/delete/", {"post": "yes"}).status_code == 403


def test_a_superuser_manages_users_and_it_is_in_the_history(staff: Any, root: Any) -> None:
    client = client_for(root)
    response = client.post(f"{ADMIN}auth/user/{staff.pk}/change/", user_form(staff, is_superuser="on"))
    assert response.status_code == 302, response.content[:2000]
    staff.refresh_from_db()
    assert staff.is_superuser
    entry = LogEntry.objects.get(object_id=str(staff.pk), content_type__model="user")
    assert entry.user == root and entry.action_flag == CHANGE and "Superuser status" in entry.get_change_message()


def test_an_api_key_changed_in_the_admin_is_in_its_history(root: Any) -> None:
    api_key, _ = create_api_key("history")
    client = client_for(root)
    response = client.post(
        f"{ADMIN}messages_api/apikey/{api_key.pk}/change/",
        {"name": "history", "priority": "standard", "requests_per_minute": "60", "allowed_models": "[]"},
    )  # `active` left out: unchecked, the key is revoked
    assert response.status_code == 302, response.content[:3000]
    api_key.refresh_from_db()
    assert not api_key.active and api_key.requests_per_minute == 60
    entry = LogEntry.objects.get(object_id=str(api_key.pk), content_type__model="apikey")
    assert entry.user == root and entry.action_flag == CHANGE
    assert "Active" in entry.get_change_message() and "Requests per minute" in entry.get_change_message()


@pytest.mark.parametrize(("action", "message"), [("drain", "Drained"), ("disable", "Disabled"), ("enable", "Enabled")])
def test_an_endpoint_action_is_in_the_endpoints_history(root: Any, action: str, message: str) -> None:
    from workers.models import WorkerEndpoint, WorkerPool

    pool = WorkerPool.objects.create(name=f"history-{action}", model="m")
    endpoint = WorkerEndpoint.objects.create(pool=pool, role="generation", url="http://10.0.0.5:8001")
    response = client_for(root).post(
        f"{ADMIN}workers/workerendpoint/", {"action": action, "_selected_action": [str(endpoint.pk)]}
    )
    assert response.status_code == 302, response.content[:3000]
    entry = LogEntry.objects.get(object_id=str(endpoint.pk), content_type__model="workerendpoint")
    assert entry.user == root and entry.action_flag == CHANGE and message in entry.get_change_message()
