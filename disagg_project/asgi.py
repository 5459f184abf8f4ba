"""ASGI entry point: the API routes go to the Channels consumers, everything else to Django; and
the hooks a gateway process installs around daphne (disagg_project/daphne.py)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "disagg_project.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402

from disagg_project import login_guard  # noqa: E402
from disagg_project.daphne import install_all  # noqa: E402
from messages_api import http_application  # noqa: E402

# Django's side first answers the admin logins of clients locked out (disagg_project/login_guard.py).
application = ProtocolTypeRouter({"http": http_application(login_guard.guard(django_asgi_app))})

# Daphne's command line imports this module before it runs the server: the hooks go in now.
install_all()
