"""The Django project: settings, URLs, the ASGI application, and what both apps share."""

from disagg_project.log_text import loggable
from disagg_project.tracebacks import drop_tracebacks

__all__ = ["drop_tracebacks", "loggable"]
