"""HTTP routing: the API paths go to the Channels consumers, everything else to Django."""

from __future__ import annotations

from typing import Any

from channels.routing import URLRouter
from django.urls import re_path


def http_application(django_asgi_app: Any) -> Any:
    return URLRouter([re_path(r"", django_asgi_app)])
