"""Settings for the test suite and the processes it starts (daphne, sim workers).

The same module serves both; the processes a test starts get the test database's URL in
DATABASE_URL (tests/support/gateway.py).
"""

import os

os.environ.setdefault("SECRET_KEY", "test-only-insecure-secret-key")

from disagg_project.settings import *  # noqa: E402,F403
from disagg_project.settings import BASE_DIR, DATABASES  # noqa: E402

# A test database of this run's own, so that concurrent runs never share one. SQLite uses a
# file, not memory: the gateway processes under test open it too.
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["default"]["TEST"] = {"NAME": str(BASE_DIR / ".gateway" / f"test-{os.getpid()}.sqlite3")}
    (BASE_DIR / ".gateway").mkdir(exist_ok=True)
else:
    DATABASES["default"]["TEST"] = {"NAME": f"test_{DATABASES['default']['NAME']}_{os.getpid()}"}
