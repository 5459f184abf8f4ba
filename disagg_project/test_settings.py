"""Settings for the test suite and the processes it starts (daphne, sim workers).

The same module serves both so that a gateway started by a test reads the test database.
"""

import os

os.environ.setdefault("SECRET_KEY", "test-only-insecure-secret-key")

from disagg_project.settings import *  # noqa: E402,F403
