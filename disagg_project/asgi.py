"""ASGI entry point: the API routes go to the Channels consumers, everything else to Django."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "disagg_project.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402

from messages_api.routing import http_application  # noqa: E402

application = ProtocolTypeRouter({"http": http_application(django_asgi_app)})
