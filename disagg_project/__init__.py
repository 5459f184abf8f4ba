"""The Django project: settings, URLs, the ASGI application, and what both apps share."""

from disagg_project.log_text import loggable

__all__ = ["loggable"]
