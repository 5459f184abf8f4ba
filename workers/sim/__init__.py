"""A simulated TensorRT-LLM disaggregated worker (context or generation), served over HTTP.

Run it with `python manage.py simworker --role context|generation --port N`; see app.py for
the routes and chat.py for the request paths. Faults are driven by `[sim ...]` directives in
the last user message (directives.py).
"""

from .app import SimApp
from .config import ROLES, Role, SimConfig
from .server import serve

__all__ = ["Role", "ROLES", "serve", "SimApp", "SimConfig"]
