"""Settings for the gateway, read from the environment (12-factor).

Every knob has a default that serves `make run`; production sets DATABASE_URL, SECRET_KEY and
ALLOWED_HOSTS. Gateway knobs are named after what they tune and documented where they are read.
"""

from __future__ import annotations

import ipaddress
import os
from datetime import timedelta
from pathlib import Path

import dj_database_url
import django_stubs_ext
from django.core.exceptions import ImproperlyConfigured

# The admin classes are generic over their model for the type checker (`ModelAdmin[ApiKey]`);
# Django's own classes do not accept the subscript at runtime until django-stubs-ext adds it.
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent

# Every file a gateway process creates is its user's alone, whatever the umask of the shell or
# service that started it: the SQLite database (admin sessions, password hashes, handoff signing
# keys) and its -wal/-shm files, and anything else written later. Set here, before the first
# database connection, in every process that loads the settings (daphne, manage.py, serve's
# children). `collectstatic` output is then 0600 too: serve it through the gateway (WhiteNoise),
# or loosen it for a web server that reads it (docs/security.md).
os.umask(0o077)


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else default


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def env_gc_thresholds(name: str, default: tuple[int, int, int]) -> tuple[int, int, int]:
    """Three non-negative ints, as "a,b,c" (gc.set_threshold's arguments)."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    parts = value.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ImproperlyConfigured(f"{name} must be three non-negative integers like 700,10,10 (got {value!r})")
    return int(parts[0]), int(parts[1]), int(parts[2])


DEBUG = env_bool("DEBUG", False)

SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is not set. Set SECRET_KEY, or DEBUG=1 for a development default."
        )
    SECRET_KEY = "dev-only-insecure-secret-key-do-not-use-in-production"
# Former secret keys, comma-separated, still accepted while a rotation lasts (Django's own list:
# sessions and signatures made under them stay valid). API keys are tagged under SECRET_KEY
# (messages_api/key_format.py): a key tagged under a secret in neither is refused at the door.
SECRET_KEY_FALLBACKS = [s.strip() for s in os.environ.get("SECRET_KEY_FALLBACKS", "").split(",") if s.strip()]

ALLOWED_HOSTS = [h.strip() for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h.strip()]
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
]

# --- Transport security (production, behind a TLS-terminating proxy) -------------------------
# All off by default so that `make run` serves plain HTTP on loopback; with them set,
# `manage.py check --deploy` is clean. They concern the Django side (the admin): the API routes
# are served by the Channels consumers, which no Django middleware sees, so an HTTPS redirect never
# applies to them, and the probes are answered before SecurityMiddleware (messages_api/probes.py).
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
# The root probe (`HEAD /`, Claude Code's) answers over plain HTTP too.
SECURE_REDIRECT_EXEMPT = [r"^$", r"^health$", r"^ready$", r"^metrics$"]
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", False)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", False)


def env_proxy_ssl_header(name: str) -> tuple[str, str] | None:
    """`HTTP_X_FORWARDED_PROTO,https` → the (header, value) pair that marks a request as HTTPS.
    Set it only behind a proxy that always sets (or strips) that header itself."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    header, sep, secure = (part.strip() for part in value.partition(","))
    if not sep or not header or not secure:
        raise ImproperlyConfigured(f"{name} must look like HTTP_X_FORWARDED_PROTO,https (got {value!r})")
    return header, secure


SECURE_PROXY_SSL_HEADER = env_proxy_ssl_header("SECURE_PROXY_SSL_HEADER")

INSTALLED_APPS = [
    "daphne",
    # Django's admin with the gateway's site: the cluster overview (messages_api/admin_site.py).
    "messages_api.admin_config.GatewayAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    # Admin login throttling and lockout (below, "The admin").
    "axes",
    "workers",
    "messages_api",
    # After django.contrib.auth: its admin module re-registers users and groups (superusers only).
    "disagg_project",
]

MIDDLEWARE = [
    # First: load-balancer probes and the metrics scrape answer for any Host (they arrive by IP)
    # and are never redirected to HTTPS; everything else keeps the host check (messages_api/probes.py).
    "messages_api.probes.ProbeMiddleware",
    # Second: a bad Host is answered 400 in Anthropic's envelope and logged as one sampled line,
    # not a traceback per request (messages_api/host_check.py).
    "messages_api.host_check.HostCheckMiddleware",
    # A locked-out client's admin login is answered 429 here, before the HTTPS redirect (a 429
    # needs none), the session, CSRF and the login view (disagg_project/login_guard.py).
    "disagg_project.login_guard.LoginLockoutMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes requires: turns a login refused by the lockout into its 429 answer.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "disagg_project.urls"
ASGI_APPLICATION = "disagg_project.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------------
# SQLite is the embedded default (WAL so readers never wait on the writer, IMMEDIATE so a write
# transaction takes its lock up front instead of failing on the read->write upgrade).
# PostgreSQL uses psycopg 3's pool; Django requires CONN_MAX_AGE=0 with it, and async code must
# not hold persistent connections anyway (the ORM runs on executor threads that outlive a request).
DATABASE_URL = os.environ.get("DATABASE_URL", f"sqlite:///{BASE_DIR / 'gateway.sqlite3'}")
_db = dj_database_url.parse(DATABASE_URL, conn_max_age=0)
if _db["ENGINE"] == "django.db.backends.sqlite3":
    _db["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
elif _db["ENGINE"] == "django.db.backends.postgresql":
    _db["OPTIONS"] = {
        "pool": {
            "min_size": env_int("DATABASE_POOL_MIN", 1),
            "max_size": env_int("DATABASE_POOL_MAX", 8),
            "timeout": 10,
        }
    }
DATABASES = {"default": _db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# --- The admin ------------------------------------------------------------------------------
# Where the admin is served (a path prefix, e.g. `ops-7f3a/`): an unguessable one keeps scanners
# off its login page; serve it only to the operators' network (docs/security.md).
ADMIN_URL = os.environ.get("ADMIN_URL", "admin/").strip("/") + "/"
if ADMIN_URL == "/":
    raise ImproperlyConfigured("ADMIN_URL must not be empty (the admin would take every path)")

# The admin's request page links a traced request's trace id through this template (`{trace_id}`
# is replaced), e.g. `http://jaeger:16686/trace/{trace_id}` or Grafana Tempo's explore URL; empty:
# the id is shown without a link. Tracing itself is configured by the OTEL_* environment
# (disagg_project/telemetry.py, docs/operating.md).
TRACE_URL_TEMPLATE = os.environ.get("TRACE_URL_TEMPLATE", "")
# Opt-in: a traced request's prompt and answer on its span, in OpenTelemetry's GenAI attributes
# (`gen_ai.input.messages`, `gen_ai.system_instructions`, `gen_ai.output.messages`), each cut to
# TRACE_RECORD_CONTENT_MAX_CHARS characters of content. Off by default: whoever reads the trace
# store reads the conversations (docs/security.md). Only sampled requests are recorded.
TRACE_RECORD_CONTENT = env_bool("TRACE_RECORD_CONTENT", False)
TRACE_RECORD_CONTENT_MAX_CHARS = env_int("TRACE_RECORD_CONTENT_MAX_CHARS", 8192)

# Login throttling (django-axes): after ADMIN_LOGIN_FAILURE_LIMIT failed logins from one client
# address, that address's logins are refused (429) for ADMIN_LOGIN_COOLOFF_S without checking the
# password. The lockout backend comes first: a refused login never reaches the password hasher,
# which costs ~200 ms of CPU per try by design. Attempts are rows in the database, so every
# gateway process sees the same count. Attempts made while locked out are not recorded (the
# cool-off is not extended, and a flood writes nothing).
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_ENABLED = True
AXES_HTTP_RESPONSE_CODE = 429
AXES_FAILURE_LIMIT = env_int("ADMIN_LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(seconds=env_float("ADMIN_LOGIN_COOLOFF_S", 900.0))
AXES_LOCKOUT_PARAMETERS = ["ip_address"]
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_RESET_ON_SUCCESS = True
# A locked-out client's refusal is sent this many seconds late (no CPU spent meanwhile): one
# connection trying passwords gets one answer per delay, however fast it sends.
ADMIN_LOGIN_LOCKOUT_DELAY_S = env_float("ADMIN_LOGIN_LOCKOUT_DELAY_S", 1.0)
# The client address: the socket peer, or behind a proxy listed in TRUSTED_PROXIES (addresses or
# networks, comma-separated) the right-most X-Forwarded-For entry it did not add itself
# (disagg_project/client_address.py). Unset behind a proxy, every client is the proxy.
TRUSTED_PROXIES = [p.strip() for p in os.environ.get("TRUSTED_PROXIES", "").split(",") if p.strip()]
for _proxy in TRUSTED_PROXIES:
    try:
        ipaddress.ip_network(_proxy, strict=False)
    except ValueError:
        raise ImproperlyConfigured(f"TRUSTED_PROXIES: {_proxy!r} is not an address or a network") from None
AXES_CLIENT_IP_CALLABLE = "disagg_project.client_address.client_address"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# Only for `collectstatic` (production may serve hashed, compressed files from here).
STATIC_ROOT = os.environ.get("STATIC_ROOT") or None
# Serve the admin's static files from the app directories under daphne without collectstatic
# (make run stays one command); production may run collectstatic for compressed, hashed files.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"request_id": {"()": "messages_api.request_context.RequestIdFilter"}},
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["request_id"]},
    },
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {
        "httpx": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
        "django.channels.server": {"level": "WARNING"},
    },
}

# systemd socket activation (sd_listen_fds(3)): how many sockets systemd passed this process. Read
# here, before the apps load: importing Twisted's endpoints (daphne does) removes LISTEN_PID and
# LISTEN_FDS from the environment of the process they name.
SYSTEMD_LISTEN_FDS = int(os.environ.get("LISTEN_FDS", "0") or 0) if os.environ.get("LISTEN_PID") == str(os.getpid()) else 0

# --- The gateway ----------------------------------------------------------------------------
# How long a streamed request waits for its pipeline before it starts the response anyway.
MESSAGES_STREAM_START_WAIT_S = env_float("MESSAGES_STREAM_START_WAIT_S", 1.0)
# A stream silent for this long gets an Anthropic `ping` event (Claude Code's stall timers are ~15 s).
MESSAGES_PING_INTERVAL_S = env_float("MESSAGES_PING_INTERVAL_S", 10.0)
# A stream's client-bound bytes the gateway queues before it stops reading the stream's worker
# (the connection's write buffer; messages_api/server/backpressure.py).
MESSAGES_CLIENT_BUFFER_BYTES = env_int("MESSAGES_CLIENT_BUFFER_BYTES", 256 * 1024)
# A streaming client that takes no byte for this long while its buffer is full is cut: the worker
# request is cancelled, the connection aborted, the row `failed` with timeout_error. 0: never.
MESSAGES_CLIENT_STALL_S = env_float("MESSAGES_CLIENT_STALL_S", 60.0)
# The whole request, from its arrival to the last byte of the answer: past it the request ends
# with 504 timeout_error (or an error event once streaming) and its reservations are released.
# 0 disables it.
MESSAGES_REQUEST_DEADLINE_S = env_float("MESSAGES_REQUEST_DEADLINE_S", 3600.0)
# Largest request body accepted (Anthropic's limit is 32 MB); larger gets 413 request_too_large.
MESSAGES_MAX_BODY_BYTES = env_int("MESSAGES_MAX_BODY_BYTES", 32 * 1024 * 1024)
# Request intake (messages_api/server/http_guard.py): enforced while daphne parses, before any body is
# buffered and before the API key is looked at. A declared Content-Length over the limit is
# refused before the body is read; a chunked body is cut at it. A request's line, headers and
# body must all arrive within this many seconds of its first byte (408 otherwise).
MESSAGES_BODY_READ_TIMEOUT_S = env_float("MESSAGES_BODY_READ_TIMEOUT_S", 30.0)
# Also decided from the headers, before the body is read (messages_api/server/header_gate.py): the
# API key of every API route (401), and the Cookie header: all of a request's Cookie headers
# together over this many bytes are refused (431), and one with a backslash (400), before Django
# parses them (Python 3.11's cookie parser is quadratic in backslashes, CVE-2024-7592: ~130 ms of
# CPU for 8 KiB of them; the admin's own cookies are ~150 bytes).
GATEWAY_MAX_COOKIE_BYTES = env_int("GATEWAY_MAX_COOKIE_BYTES", 8192)
# API keys (messages_api/auth.py). Only a key the gateway issued (its tag checks) or one issued
# before keys carried a tag (their hashes are loaded from the database, and again every
# GATEWAY_LEGACY_KEYS_REFRESH_S) is looked up; any other is refused without a query. At most
# GATEWAY_KEY_LOOKUP_CONCURRENCY lookups run at once (each holds a database connection on a
# thread); one that waits GATEWAY_KEY_LOOKUP_WAIT_S for its turn is answered 529 overloaded_error.
GATEWAY_KEY_LOOKUP_CONCURRENCY = env_int("GATEWAY_KEY_LOOKUP_CONCURRENCY", 4)
GATEWAY_KEY_LOOKUP_WAIT_S = env_float("GATEWAY_KEY_LOOKUP_WAIT_S", 2.0)
GATEWAY_LEGACY_KEYS_REFRESH_S = env_float("GATEWAY_LEGACY_KEYS_REFRESH_S", 60.0)
# Failed authentications per client address (messages_api/server/auth_throttle.py): this many at
# once, then one each 60/N seconds; past that, the address's requests without a key this process
# knows to be valid are answered 429 rate_limit_error with retry-after, without a lookup. The
# address is the socket's peer, or behind TRUSTED_PROXIES the client they name; an IPv6 client
# counts by its /64. 0: no throttle.
GATEWAY_AUTH_FAILURES_PER_MINUTE = env_int("GATEWAY_AUTH_FAILURES_PER_MINUTE", 60)
# Connections (messages_api/server/http_guard.py): a client address (the socket's peer) with this
# many connections open has its next one closed at accept (0: no cap). Above what one address
# legitimately holds open at once (a stream holds its connection; bench/stream_start.py runs 2,000
# from loopback), below the process's file limit (systemd unit: 65,536); behind a proxy on the same
# host every connection is the proxy's: set it above the proxy's connections to one process, and
# cap per client at the proxy. A connection with no request in progress is closed after this many
# seconds of silence (above the proxies' keep-alive timeouts: nginx's upstream 60 s, a load
# balancer's 60 s; 0: never).
GATEWAY_MAX_CONNECTIONS_PER_ADDRESS = env_int("GATEWAY_MAX_CONNECTIONS_PER_ADDRESS", 4096)
GATEWAY_IDLE_CONNECTION_TIMEOUT_S = env_float("GATEWAY_IDLE_CONNECTION_TIMEOUT_S", 75.0)
# Deepest JSON nesting accepted in a request body (400 beyond): orjson parses 1,024 levels but
# cannot re-encode past 254, which the worker request needs (tool schemas, tool_use inputs).
MESSAGES_MAX_JSON_DEPTH = env_int("MESSAGES_MAX_JSON_DEPTH", 64)
# Bounded work per request (messages_api/intake.py): at most this many messages, content blocks
# (system, message and tool-result blocks together) and JSON objects in a body (413 beyond), and
# a body of at least MESSAGES_OFFLOAD_BYTES is parsed, validated and converted on a thread of its
# own, one at a time, instead of on the event loop.
MESSAGES_MAX_MESSAGES = env_int("MESSAGES_MAX_MESSAGES", 10_000)
MESSAGES_MAX_CONTENT_BLOCKS = env_int("MESSAGES_MAX_CONTENT_BLOCKS", 20_000)
MESSAGES_MAX_JSON_OBJECTS = env_int("MESSAGES_MAX_JSON_OBJECTS", 100_000)
MESSAGES_OFFLOAD_BYTES = env_int("MESSAGES_OFFLOAD_BYTES", 512 * 1024)
# ...and one of at least MESSAGES_ISOLATE_BYTES in a process of its own (0: never), where its
# single C calls over one huge string do not hold this process's interpreter.
MESSAGES_ISOLATE_BYTES = env_int("MESSAGES_ISOLATE_BYTES", 4 * 1024 * 1024)
# New API requests are answered 529 while the event loop runs this late (seconds; 0: never):
# the requests already running recover instead of everyone slowing down together.
GATEWAY_SHED_LOOP_LAG_S = env_float("GATEWAY_SHED_LOOP_LAG_S", 0.5)

# Worker HTTP client. Every *_TIMEOUT_S below but the connect one is a deadline for a whole phase,
# not a per-read timeout: a worker trickling a byte at a time cannot hold a request past it. A
# passed deadline is a 504 `timeout` (workers.wire.client).
WORKER_CONNECT_TIMEOUT_S = env_float("WORKER_CONNECT_TIMEOUT_S", 5.0)
# The whole context-phase call, from sending it to the last byte of its answer (the prefill of a
# long prompt may take minutes).
WORKER_CONTEXT_TIMEOUT_S = env_float("WORKER_CONTEXT_TIMEOUT_S", 600.0)
# From sending a generation request to the first byte of its stream's body. When the generation
# request goes out before the context phase (generation first), its worker cannot answer until that
# phase ends, so WORKER_CONTEXT_TIMEOUT_S is added.
WORKER_FIRST_BYTE_TIMEOUT_S = env_float("WORKER_FIRST_BYTE_TIMEOUT_S", 120.0)
# The longest a generation stream may go without a complete event once the gateway waits for one
# (bytes that do not complete an event do not count).
WORKER_IDLE_TIMEOUT_S = env_float("WORKER_IDLE_TIMEOUT_S", 120.0)
# The longest any one worker call may last from sending it to its end (a generation stream
# included), and the deadline of calls that have no phase deadline of their own.
WORKER_REQUEST_TIMEOUT_S = env_float("WORKER_REQUEST_TIMEOUT_S", 1800.0)
# The longest line (or event) of a worker's event stream; longer is a 502, never buffered further.
WORKER_MAX_SSE_LINE_BYTES = env_int("WORKER_MAX_SSE_LINE_BYTES", 8 * 1024 * 1024)
# The largest non-streamed worker answer read; larger is a 502, cut as soon as it is exceeded.
WORKER_MAX_JSON_BYTES = env_int("WORKER_MAX_JSON_BYTES", 64 * 1024 * 1024)
# Open connections per worker endpoint (a streamed request holds one for its whole answer).
WORKER_MAX_CONNECTIONS = env_int("WORKER_MAX_CONNECTIONS", 4096)
# An idle kept-alive connection is reused only this long: below the 5 s after which uvicorn (and
# so trtllm-serve) closes one, so a reuse rarely races the server's close.
WORKER_KEEPALIVE_EXPIRY_S = env_float("WORKER_KEEPALIVE_EXPIRY_S", 4.0)
# A worker's answer is refused (an httpx.RemoteProtocolError, so a worker error) past this many
# header fields or this many bytes of header fields: a broken or hostile worker cannot make the
# gateway buffer an unbounded head (aiohttp's parser also refuses one field over 8,190 bytes).
WORKER_MAX_RESPONSE_HEADERS = env_int("WORKER_MAX_RESPONSE_HEADERS", 100)
WORKER_MAX_RESPONSE_HEADER_BYTES = env_int("WORKER_MAX_RESPONSE_HEADER_BYTES", 64 * 1024)
# After a client leaves once the context phase is done, how long the gateway waits for the
# generation worker to take the KV handoff (so the context worker frees it) before closing.
WORKER_HANDOFF_RELEASE_TIMEOUT_S = env_float("WORKER_HANDOFF_RELEASE_TIMEOUT_S", 5.0)
# On SIGTERM, stop accepting and let requests in flight finish for this long before cancelling
# them (messages_api/server/drain.py); 0 stops at once. Below the usual 30 s grace of an orchestrator.
GATEWAY_DRAIN_TIMEOUT_S = env_float("GATEWAY_DRAIN_TIMEOUT_S", 25.0)
# Write response bytes straight to the client's socket when nothing is queued before them, instead
# of on the next loop iteration (messages_api/server/direct_write.py); off only to compare.
GATEWAY_DIRECT_WRITES = env_bool("GATEWAY_DIRECT_WRITES", True)

# --- Tenancy: shared state, admission, per-key limits (docs/tenancy.md) -----------------------
# Redis shared by every gateway process and host: per-key limits and budgets, per-key concurrency
# and endpoint capacity hold across all of them. Unset (the embedded default), each process keeps
# its own. A Redis that stops answering makes each process fall back to its own state (logged,
# counted in gateway_shared_state_fallbacks_total) and is tried again REDIS_RETRY_S later.
REDIS_URL = os.environ.get("REDIS_URL", "")
REDIS_TIMEOUT_S = env_float("REDIS_TIMEOUT_S", 0.25)
REDIS_RETRY_S = env_float("REDIS_RETRY_S", 5.0)
# Scripts in flight at once on an event loop's one connection to Redis (it is pipelined); a check
# past it waits for a reply to make room (bounded by REDIS_TIMEOUT_S: a late reply closes it).
REDIS_MAX_IN_FLIGHT = env_int("REDIS_MAX_IN_FLIGHT", 256)
# Every key the gateway writes starts with this (several deployments may share one Redis).
REDIS_KEY_PREFIX = os.environ.get("REDIS_KEY_PREFIX", "gw:")
# A capacity slot held through Redis expires unless its process renews it: a process that dies
# frees its slots within this long. Renewed every third of it.
CAPACITY_LEASE_S = env_float("CAPACITY_LEASE_S", 30.0)
# The admission queue (workers/admission/queue.py): a request that finds every suitable endpoint
# at capacity waits in the gateway, not in an engine's queue, for the first slot that frees; past
# ADMISSION_QUEUE_TIMEOUT_S, or when the queue holds ADMISSION_QUEUE_MAX_REQUESTS requests or
# ADMISSION_QUEUE_MAX_BYTES of them, the answer is 529 overloaded_error with a retry-after of
# ADMISSION_RETRY_AFTER_S (at most 59: Claude Code gives up at once on a longer one).
ADMISSION_QUEUE_TIMEOUT_S = env_float("ADMISSION_QUEUE_TIMEOUT_S", 30.0)
ADMISSION_QUEUE_MAX_REQUESTS = env_int("ADMISSION_QUEUE_MAX_REQUESTS", 2000)
ADMISSION_QUEUE_MAX_BYTES = env_int("ADMISSION_QUEUE_MAX_BYTES", 512 * 1024 * 1024)
ADMISSION_RETRY_AFTER_S = min(59.0, env_float("ADMISSION_RETRY_AFTER_S", 5.0))
# How often the head of a queue looks for a slot freed elsewhere (another process, a capacity
# raised in the admin); slots freed in this process wake it at once.
ADMISSION_POLL_INTERVAL_S = env_float("ADMISSION_POLL_INTERVAL_S", 0.05)
# Headroom (workers/admission/headroom.py): while several keys use a capped pool, the largest
# holder over its fair share (or a key of a lower class than another active one) must leave free
# what the other active keys' shares leave unused, at most this fraction of the pool's slots
# (rounded down: 0 disables it). A key is active while it holds or waits for a slot, and
# ADMISSION_ACTIVE_FLOW_S after it last asked. bench/tenants.py (docs/tenancy.md): 0.25 keeps
# well-behaved keys out of the queue behind a flood at p90 (their p99 still waits 0.3-0.4 s for a
# release); 0.5 at p99, for about 30 % less throughput to the flood.
ADMISSION_HEADROOM = env_float("ADMISSION_HEADROOM", 0.5)
# Slots of that headroom each lower class (below the highest class active on the pool) may hold
# at once, so that a batch key is not starved while the headroom sits idle beside a higher
# class's flood; 0: strict priority (a lower class gets only what no higher one is kept from).
ADMISSION_LOWER_CLASS_FLOOR = env_int("ADMISSION_LOWER_CLASS_FLOOR", 1)
# Beyond its floor, a lower class leaves at least this fraction of a capped pool free while a
# higher class is active (rounded down; at most ADMISSION_HEADROOM), for the higher keys' bursts.
ADMISSION_LOWER_CLASS_HEADROOM = env_float("ADMISSION_LOWER_CLASS_HEADROOM", 0.25)
# How long a Python thread may hold the GIL while another waits for it (sys.setswitchinterval;
# Python's default 0.005). Daphne's loop thread waits for it behind the thread that parses large
# bodies (disagg_project/daphne.py): bench/large_requests.py, 20,000-block bodies in a loop, /health
# p99 111 ms at 0.005, 53 ms at 0.0005.
PYTHON_SWITCH_INTERVAL_S = env_float("PYTHON_SWITCH_INTERVAL_S", 0.0005)
# The garbage collector's thresholds (gc.set_threshold: allocations before a young pass, young
# passes before a middle one, middle passes before a full one), as "a,b,c"; Python's are
# 700,10,10. A full pass walks every live object made since start-up: under a flood that is the
# requests waiting in the admission queue, 30-65 ms a pass (bench/results/2026-12-05-gc-cycles.md),
# and every stream in flight stalls with it. The requests leave no reference cycles behind
# (disagg_project/tracebacks.py), so a full pass finds almost nothing to free: one every 100
# middle passes instead of 10 (bench/tenants.py admission: 7 full passes in 50 s -> 0).
GATEWAY_GC_THRESHOLDS = env_gc_thresholds("GATEWAY_GC_THRESHOLDS", (700, 10, 100))
ADMISSION_ACTIVE_FLOW_S = env_float("ADMISSION_ACTIVE_FLOW_S", 10.0)

# --- Message Batches (messages_api/batches/, docs/batches.md) ---------------------------------
# A create body over BATCH_MAX_BYTES is refused (413 request_too_large) before it is read; one of
# more than BATCH_MAX_REQUESTS requests with 400. Anthropic's limits are 256 MB and 100,000; the
# body is parsed whole (on a thread), so the default byte limit is lower.
BATCH_MAX_BYTES = env_int("BATCH_MAX_BYTES", 64 * 1024 * 1024)
BATCH_MAX_REQUESTS = env_int("BATCH_MAX_REQUESTS", 100_000)
# A batch's unfinished items expire this long after it was created (Anthropic: 24 h); its results
# are kept BATCH_RESULTS_RETENTION_S after its creation (Anthropic: 29 days), then archived by
# `prune_audit` (the batch stays visible, its results are gone).
BATCH_EXPIRY_S = env_float("BATCH_EXPIRY_S", 24 * 3600.0)
BATCH_RESULTS_RETENTION_S = env_float("BATCH_RESULTS_RETENTION_S", 29 * 24 * 3600.0)
# The runner in every gateway process (BATCH_RUNNER_ENABLED): at most BATCH_MAX_IN_FLIGHT items of
# its own running at once, and new claims (BATCH_CLAIM_SIZE at a time) only while fewer than
# BATCH_QUEUE_TARGET of its batch requests wait in the admission queue; with nothing to claim it
# looks again every BATCH_POLL_INTERVAL_S (a batch created in the process wakes it at once).
BATCH_RUNNER_ENABLED = env_bool("BATCH_RUNNER_ENABLED", True)
BATCH_MAX_IN_FLIGHT = env_int("BATCH_MAX_IN_FLIGHT", 64)
BATCH_QUEUE_TARGET = env_int("BATCH_QUEUE_TARGET", 4)
BATCH_CLAIM_SIZE = env_int("BATCH_CLAIM_SIZE", 16)
BATCH_POLL_INTERVAL_S = env_float("BATCH_POLL_INTERVAL_S", 1.0)
# A claimed item's lease, renewed every third of it while the item runs; a lease expired for half
# of it more goes back to the queue (a process that died on another host). The sweep (expiry,
# cancellation, leases, batches ending) runs every BATCH_SWEEP_INTERVAL_S in every process.
BATCH_LEASE_S = env_float("BATCH_LEASE_S", 60.0)
BATCH_SWEEP_INTERVAL_S = env_float("BATCH_SWEEP_INTERVAL_S", 5.0)
# An item refused for load (429, 503, 529) is tried again after BATCH_RETRY_BASE_S, doubling per
# attempt up to BATCH_RETRY_MAX_S, until its batch expires; other server errors at most
# BATCH_MAX_ATTEMPTS times, then the item is `errored`.
BATCH_RETRY_BASE_S = env_float("BATCH_RETRY_BASE_S", 1.0)
BATCH_RETRY_MAX_S = env_float("BATCH_RETRY_MAX_S", 60.0)
BATCH_MAX_ATTEMPTS = env_int("BATCH_MAX_ATTEMPTS", 3)
# Results are read from the database this many items at a time.
BATCH_RESULTS_CHUNK = env_int("BATCH_RESULTS_CHUNK", 500)

# How often each process re-reads pools and endpoints from the database.
REGISTRY_REFRESH_INTERVAL_S = env_float("REGISTRY_REFRESH_INTERVAL_S", 1.0)

# The audit/reservation writer batches rows: it writes this long after the first row of a batch
# came. A transaction's cost is mostly the pages it rewrites (SQLite: ~13 for one audit row, whose
# table has nine indexes; rows written together share most of them), so the window sets the
# writer's CPU: at 10 streams/s, 1.1 ms per stream at 50 ms and 0.56 at 250 ms
# (disagg_project/writer.py). It is also how long a row may live only in memory.
AUDIT_FLUSH_INTERVAL_S = env_float("AUDIT_FLUSH_INTERVAL_S", 0.25)
# Requests refused without a valid API key are all counted (gateway_unauthenticated_rejections_total)
# but only this many per second per process get an audit row, so a flood cannot fill the database.
AUDIT_UNAUTHENTICATED_SAMPLE_PER_S = env_float("AUDIT_UNAUTHENTICATED_SAMPLE_PER_S", 1.0)
# Likewise a known key's requests refused before they were accepted (429 over a limit, 400, 529
# shed): all counted (metrics, the key's usage), at most this many rows per second per key and
# process (bursts of as many), each saying how many it stands for. An accepted request always
# gets its row.
AUDIT_REFUSED_SAMPLE_PER_S = env_float("AUDIT_REFUSED_SAMPLE_PER_S", 5.0)
# Usage per API key and UTC hour (messages_api/usage.py) is written with the audit rows, in their
# transaction (AUDIT_FLUSH_INTERVAL_S). `prune_audit` deletes hours older than
# USAGE_HOURS_RETENTION_DAYS (at least 31: the admin charts the last 30 days, and days are sums of
# hours).
USAGE_HOURS_RETENTION_DAYS = env_int("USAGE_HOURS_RETENTION_DAYS", 90)

# Health: each process probes every endpoint's /health; an endpoint is unhealthy after
# HEALTH_UNHEALTHY_AFTER consecutive failed checks and healthy again after HEALTH_HEALTHY_AFTER.
HEALTH_CHECK_INTERVAL_S = env_float("HEALTH_CHECK_INTERVAL_S", 5.0)
HEALTH_CHECK_TIMEOUT_S = env_float("HEALTH_CHECK_TIMEOUT_S", 2.0)
HEALTH_UNHEALTHY_AFTER = env_int("HEALTH_UNHEALTHY_AFTER", 3)
HEALTH_HEALTHY_AFTER = env_int("HEALTH_HEALTHY_AFTER", 2)
# The probe result is written to the database on every change and at least this often (the
# admin's "last checked" shows that probing happens).
HEALTH_WRITE_INTERVAL_S = env_float("HEALTH_WRITE_INTERVAL_S", 5.0)
# Circuit breaker per endpoint: open after this many consecutive request failures (5xx,
# unreachable, broken stream), let one trial request through after the cool-down.
BREAKER_FAILURE_THRESHOLD = env_int("BREAKER_FAILURE_THRESHOLD", 5)
BREAKER_COOLDOWN_S = env_float("BREAKER_COOLDOWN_S", 30.0)
# A worker 5xx answer (not overload, not a timeout) may follow one client's prompt: it counts
# toward the breaker only once this many distinct API keys saw one from the endpoint within
# BREAKER_KEY_WINDOW_S, so one key cannot open the breaker for everyone (1: every such failure
# counts).
BREAKER_DISTINCT_KEYS = env_int("BREAKER_DISTINCT_KEYS", 2)
BREAKER_KEY_WINDOW_S = env_float("BREAKER_KEY_WINDOW_S", 60.0)

# Engine-reported load (workers/cluster/engine_load.py, docs/engines.md): every ENGINE_LOAD_POLL_S
# (0: off) the gateway reads each endpoint's Prometheus metrics (its engine's queue, running
# requests and KV-cache use), within ENGINE_LOAD_TIMEOUT_S and at most ENGINE_LOAD_MAX_BYTES of
# answer. With Redis one process polls each endpoint and the others read what it published. Figures
# older than ENGINE_LOAD_MAX_AGE_S are ignored: routing falls back to the gateway's own counts.
# Routing counts an endpoint as busy as the larger of the gateway's own open requests and the
# engine's waiting + running; a KV cache fuller than ENGINE_LOAD_KV_THRESHOLD adds up to
# ENGINE_LOAD_KV_PENALTY requests more (the penalty at a full cache).
ENGINE_LOAD_POLL_S = env_float("ENGINE_LOAD_POLL_S", 1.0)
ENGINE_LOAD_TIMEOUT_S = env_float("ENGINE_LOAD_TIMEOUT_S", 1.0)
ENGINE_LOAD_MAX_AGE_S = env_float("ENGINE_LOAD_MAX_AGE_S", 5.0)
ENGINE_LOAD_MAX_BYTES = env_int("ENGINE_LOAD_MAX_BYTES", 2 * 1024 * 1024)
ENGINE_LOAD_KV_THRESHOLD = env_float("ENGINE_LOAD_KV_THRESHOLD", 0.9)
ENGINE_LOAD_KV_PENALTY = env_int("ENGINE_LOAD_KV_PENALTY", 8)
# Admission on the same figures: an endpoint whose engine reports at least
# ENGINE_LOAD_ADMIT_MAX_WAITING requests waiting, or a KV cache at least
# ENGINE_LOAD_ADMIT_MAX_KV_USAGE full (a fraction), counts as full while the figures are fresh, and
# requests wait in the gateway's admission queue (priorities, fair shares) instead of the
# engine's. 0: off (the default; admission then reads nothing of the engines).
ENGINE_LOAD_ADMIT_MAX_WAITING = env_int("ENGINE_LOAD_ADMIT_MAX_WAITING", 0)
ENGINE_LOAD_ADMIT_MAX_KV_USAGE = env_float("ENGINE_LOAD_ADMIT_MAX_KV_USAGE", 0.0)

# KV-cache events (workers/kv_events/, docs/engines.md): endpoints with a KV-event address are
# subscribed to on a thread of their own. Per endpoint at most KV_EVENTS_MAX_BLOCKS blocks are
# indexed and KV_EVENTS_DIGESTS_KEPT digests kept to check hashes; at most KV_EVENTS_HWM messages
# wait in a socket, each at most KV_EVENTS_MAX_BYTES. A replay answers within
# KV_EVENTS_REPLAY_TIMEOUT_S; after one that did not, gaps are not replayed (their events are
# lost, the endpoint falls back) for KV_EVENTS_REPLAY_BACKOFF_S. An endpoint sent requests but no event for KV_EVENTS_SILENCE_S is
# routed on the approximate prefix index until its events resume; KV_EVENTS_CHECK_S is how often
# that is checked.
KV_EVENTS_MAX_BLOCKS = env_int("KV_EVENTS_MAX_BLOCKS", 1_000_000)
KV_EVENTS_DIGESTS_KEPT = env_int("KV_EVENTS_DIGESTS_KEPT", 65536)
KV_EVENTS_HWM = env_int("KV_EVENTS_HWM", 100_000)
KV_EVENTS_MAX_BYTES = env_int("KV_EVENTS_MAX_BYTES", 16 * 1024 * 1024)
KV_EVENTS_REPLAY_TIMEOUT_S = env_float("KV_EVENTS_REPLAY_TIMEOUT_S", 5.0)
KV_EVENTS_REPLAY_BACKOFF_S = env_float("KV_EVENTS_REPLAY_BACKOFF_S", 30.0)
KV_EVENTS_SILENCE_S = env_float("KV_EVENTS_SILENCE_S", 30.0)
KV_EVENTS_CHECK_S = env_float("KV_EVENTS_CHECK_S", 1.0)
# Block keys of prompts learned from the workers' answers (the join of conversations to blocks;
# 8 bytes each): the least recently learned prompts go past it.
KV_EVENTS_LEARNED_BLOCKS = env_int("KV_EVENTS_LEARNED_BLOCKS", 4_000_000)
# With REDIS_URL, each learned prompt is shared with every gateway process through one Redis
# stream (workers/kv_events/shared.py): a conversation's next turn scores on it whichever process
# it reaches. Entries older than KV_EVENTS_SHARED_TTL_S go (0: nothing is shared), the stream keeps
# about KV_EVENTS_SHARED_ENTRIES of them, and a prompt of more than KV_EVENTS_SHARED_MAX_BLOCKS
# blocks stays in the process that learned it: Redis holds at most about entries x max blocks x 8
# bytes (256 MiB with these defaults; 43 MB of 21k-token prompts, 1,300 blocks of 16 each).
KV_EVENTS_SHARED_TTL_S = env_float("KV_EVENTS_SHARED_TTL_S", 1800.0)
KV_EVENTS_SHARED_ENTRIES = env_int("KV_EVENTS_SHARED_ENTRIES", 4096)
KV_EVENTS_SHARED_MAX_BLOCKS = env_int("KV_EVENTS_SHARED_MAX_BLOCKS", 8192)

# Each process writes a heartbeat; one silent for GATEWAY_DEAD_AFTER_S is dead and its open
# reservations and in-progress audit rows are closed by the next live process that sweeps.
GATEWAY_HEARTBEAT_INTERVAL_S = env_float("GATEWAY_HEARTBEAT_INTERVAL_S", 5.0)
GATEWAY_DEAD_AFTER_S = env_float("GATEWAY_DEAD_AFTER_S", 3 * GATEWAY_HEARTBEAT_INTERVAL_S)
# A process on the same host is judged by its PID instead (workers/cluster/recovery.py), and counted as
# hung, hence dead, only when its heartbeat is this old: a starved host delays heartbeats.
GATEWAY_HUNG_AFTER_S = env_float("GATEWAY_HUNG_AFTER_S", 300.0)

# /metrics is served to loopback clients (the socket's own peer address, on a request no proxy
# forwarded), or, when this is set, only to clients presenting `Authorization: Bearer <token>`
# (messages_api/server/header_gate.py). METRICS_BEARER_TOKEN is its former name, still read.
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")
_metrics_bearer_token = os.environ.get("METRICS_BEARER_TOKEN", "")
if METRICS_TOKEN and _metrics_bearer_token and METRICS_TOKEN != _metrics_bearer_token:
    raise ImproperlyConfigured("METRICS_TOKEN and METRICS_BEARER_TOKEN (its former name) are both set, to different tokens")
METRICS_TOKEN = METRICS_TOKEN or _metrics_bearer_token
# Per-key counters (gateway_key_requests_total{key,status}, gateway_key_tokens_total{key,kind}):
# one time series per API key and label value, so off unless the operator wants that cardinality.
METRICS_PER_KEY_LABELS = env_bool("METRICS_PER_KEY_LABELS", False)

# Prefix-cache-aware routing (`cache_aware`, workers/routing/prefix_index.py). The gateway's index of what
# each endpoint holds: prompts digested part by part (tools, then each message), with a mark kept
# about every CHUNK_BYTES of prompt (about a quarter as many tokens) plus one at the shared head's
# end and one at the prompt's end; at most CHUNKS_PER_ENDPOINT marks per endpoint (LRU; size it
# like the worker's KV cache: 8192 marks of 16 KiB is about 32M tokens of prompt, more than any
# one worker holds, so lower it to the workers' KV capacity), a mark not sent for the TTL
# counting as evicted.
PREFIX_INDEX_CHUNK_BYTES = env_int("PREFIX_INDEX_CHUNK_BYTES", 16384)
PREFIX_INDEX_CHUNKS_PER_ENDPOINT = env_int("PREFIX_INDEX_CHUNKS_PER_ENDPOINT", 8192)
PREFIX_INDEX_TTL_S = env_float("PREFIX_INDEX_TTL_S", 1800.0)
# Load guard (SGLang's cache-aware policy): the endpoint with the longest match is skipped for the
# least loaded one when its open requests exceed the least loaded's by more than ABS and by a
# factor of more than REL.
PREFIX_BALANCE_ABS_THRESHOLD = env_int("PREFIX_BALANCE_ABS_THRESHOLD", 4)
PREFIX_BALANCE_REL_THRESHOLD = env_float("PREFIX_BALANCE_REL_THRESHOLD", 1.5)
# A new conversation goes to the one of its two rendezvous endpoints serving fewer conversations:
# those with a turn sent there within this window (Claude Code's turns come seconds to minutes
# apart).
PREFIX_BALANCE_WINDOW_S = env_float("PREFIX_BALANCE_WINDOW_S", 300.0)
