"""The Django project: settings, URLs, the ASGI application, and what both apps share."""

from disagg_project.client_address import address_of
from disagg_project.log_text import loggable
from disagg_project.tracebacks import drop_tracebacks

__all__ = ["address_of", "drop_tracebacks", "loggable"]
