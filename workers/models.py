"""The serving cluster as operators register it: pools of context and generation endpoints, and
the reservations the router holds on them."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models

from workers import protocols
from workers.protocols import base as schedules


class ScheduleStyle(models.TextChoices):
    """How a request's worker calls are ordered (see `workers.protocols.base`)."""

    CONTEXT_FIRST = schedules.CONTEXT_FIRST, "context first"
    GENERATION_FIRST = schedules.GENERATION_FIRST, "generation first"
    AGGREGATED = schedules.AGGREGATED, "aggregated (no context phase)"


class RoutingPolicy(models.TextChoices):
    ROUND_ROBIN = "round_robin", "round robin"
    LEAST_LOADED = "least_loaded", "least loaded"
    SESSION_AFFINITY = "session_affinity", "session affinity"
    CACHE_AWARE = "cache_aware", "cache aware (prefix cache)"


class CacheScope(models.TextChoices):
    """Whose prompts one request may reuse from the workers' prefix caches (docs/security.md).

    A cache hit is visible to the client (`cache_read_input_tokens`, and a faster first token),
    so a shared cache tells one key whether another sent a prompt."""

    # Each API key its own cache; keys that name the same cache group share one.
    KEY = "key", "per key (or cache group)"
    # Every key reuses every other key's prompts.
    SHARED = "shared", "shared by every key"


class Role(models.TextChoices):
    CONTEXT = "context", "context"
    GENERATION = "generation", "generation"


class Stage(models.TextChoices):
    """Where a request is (or ended): shared by reservations and the request audit."""

    RECEIVED = "received", "received"
    CONTEXT = "context", "context"
    GENERATION = "generation", "generation"
    DONE = "done", "done"


class WorkerPool(models.Model):
    """A set of context and generation endpoints that serve one model."""

    name = models.CharField(max_length=100, unique=True)
    model = models.CharField(
        max_length=200, db_index=True, help_text="The request `model` this pool serves."
    )
    schedule_style = models.CharField(
        max_length=20, choices=ScheduleStyle.choices, default=ScheduleStyle.CONTEXT_FIRST
    )
    max_local_prefill_tokens = models.PositiveIntegerField(
        default=0,
        help_text="Prompts of at most this many tokens skip the context phase "
        "(conditional disaggregation). 0 always disaggregates.",
    )
    routing = models.CharField(
        max_length=20, choices=RoutingPolicy.choices, default=RoutingPolicy.ROUND_ROBIN
    )
    # Choices are read from the protocol registry when used, so registering a protocol needs no
    # migration.
    protocol = models.CharField(
        max_length=20,
        choices=protocols.choices,
        default=protocols.DEFAULT,
        help_text="The protocol the pool's workers speak; it decides which schedule styles the pool can use.",
    )
    handoff_signing_key = models.CharField(
        max_length=256,
        blank=True,
        default="",
        help_text="Shared secret the pool's workers verify signed handoffs with (TensorRT-LLM's "
        "disaggregated auth key). Write-only: never shown after saving.",
    )
    cache_scope = models.CharField(
        max_length=20,
        choices=CacheScope.choices,
        default=CacheScope.KEY,
        help_text="Whose prompts a request may reuse from the workers' prefix caches. Per key: the engines' "
        "caches are salted per API key (or cache group), and no key is told of another's cache hit. "
        "Shared: hits across keys, and a key can tell whether another sent a prompt.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.model})"

    def clean(self) -> None:
        problem = protocols.misconfiguration(self.protocol, self.schedule_style, self.max_local_prefill_tokens)
        if problem is not None:
            if protocols.lookup(self.protocol) is None:
                field = "protocol"
            elif protocols.misconfiguration(self.protocol, self.schedule_style) is None:
                field = "max_local_prefill_tokens"
            else:
                field = "schedule_style"
            raise ValidationError({field: problem})


class KvHashAlgorithm(models.TextChoices):
    """The `--prefix-caching-hash-algo` values whose hashes the gateway reproduces, and `tokens`."""

    NONE = "", "not checked"
    SHA256 = "sha256", "sha256 (pickle; vLLM's default)"
    SHA256_CBOR = "sha256_cbor", "sha256_cbor"
    # Not an engine's: blocks keyed by their tokens (workers.kv_events.hashing.TokenKeys), for an
    # engine whose hashes the gateway does not reproduce (SGLang, TensorRT-LLM, a seedless vLLM).
    TOKENS = "tokens", "by their tokens (any engine; hashes not checked)"


class WorkerEndpoint(models.Model):
    """One worker server (e.g. a `trtllm-serve` instance) in a pool, in one role."""

    pool = models.ForeignKey(WorkerPool, on_delete=models.CASCADE, related_name="endpoints")
    role = models.CharField(max_length=20, choices=Role.choices)
    url = models.URLField(max_length=300, help_text="Base URL, e.g. http://10.0.0.5:8001")
    enabled = models.BooleanField(default=True)
    draining = models.BooleanField(
        default=False, help_text="Finish in-flight requests, take no new ones."
    )
    healthy = models.BooleanField(default=True)
    last_checked_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    consecutive_failures = models.PositiveIntegerField(default=0)
    options = models.JSONField(
        default=dict,
        blank=True,
        help_text='Protocol-specific options, e.g. {"bootstrap_port": 8998} for an SGLang prefill server.',
    )
    # The router never sends an endpoint more than this; a request that finds every suitable
    # endpoint full waits in the gateway's admission queue (workers/admission/).
    capacity = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Most requests in flight at once on this endpoint, across every gateway process. Empty: unlimited.",
    )
    capacity_tokens = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="Most tokens in flight at once (each request's prompt + max_tokens). Empty: unlimited. "
        "A request larger than this alone is admitted when the endpoint is idle.",
    )
    kv_events_address = models.CharField(
        max_length=300, blank=True, default="",
        help_text="The engine's KV-cache event publisher (its --kv-events-config endpoint), e.g. tcp://10.0.0.5:5557. "
        "Empty: the gateway routes this endpoint on its own approximate prefix index.",
    )
    kv_events_replay_address = models.CharField(
        max_length=300, blank=True, default="",
        help_text="The engine's replay socket (replay_endpoint), e.g. tcp://10.0.0.5:5558. Empty: missed events cannot be replayed.",
    )
    kv_events_topic = models.CharField(max_length=200, blank=True, default="", help_text="The publisher's topic (empty: every topic).")
    kv_block_size = models.PositiveIntegerField(
        null=True, blank=True, help_text="The engine's KV block size in tokens (--block-size). Empty: 16."
    )
    kv_hash_algorithm = models.CharField(
        max_length=20, blank=True, default="sha256", choices=KvHashAlgorithm.choices,
        help_text="The engine's --prefix-caching-hash-algo, to check the block hashes it publishes; "
        "'by their tokens' for an engine whose hashes the gateway does not reproduce (SGLang, TensorRT-LLM). Empty: followed, not routed on.",
    )
    kv_hash_seed = models.CharField(
        max_length=200, blank=True, default="",
        help_text="The engine's PYTHONHASHSEED, if set (empty: vLLM's fixed default seed).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["pool", "role", "id"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "role", "url"], name="unique_endpoint_per_pool_role")
        ]

    def __str__(self) -> str:
        return f"{self.pool.name}/{self.role} {self.url}"

    def clean(self) -> None:
        problems = {}
        for name in ("kv_events_address", "kv_events_replay_address"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://")):
                problems[name] = "A ZeroMQ address: tcp://host:port or ipc://path."
            elif value.startswith("tcp://") and ("*" in value or value.rsplit(":", 1)[-1] in ("", "0") or not value.rsplit(":", 1)[-1].isdigit()):
                problems[name] = "The engine's address and port to connect to (not its bind address with *)."
        if self.kv_events_replay_address and not self.kv_events_address:
            problems["kv_events_replay_address"] = "A replay address needs the KV-event address too."
        if self.kv_block_size is not None and self.kv_block_size < 1:
            problems["kv_block_size"] = "At least 1 token."
        if problems:
            raise ValidationError(problems)


class ModelRoute(models.Model):
    """A model name clients ask for — exact (`claude-sonnet-4-6`) or a pattern (`claude-sonnet-*`) —
    and the pools that serve it, in preference order: when the first has no usable endpoint with
    room, the next serves. A pool's own `model` is a public name too, without a route."""

    name = models.CharField(
        max_length=200, unique=True,
        help_text='Exact ("claude-sonnet-4-6") or a pattern with * and ? ("claude-sonnet-*"). Exact names are listed by /v1/models.',
    )
    display_name = models.CharField(max_length=200, blank=True, default="", help_text="Shown by /v1/models (and Claude Code's /model picker).")
    upstream_model = models.CharField(
        max_length=200, blank=True, default="", help_text="The model name sent to the workers; empty: each pool's own model."
    )
    pools: models.ManyToManyField[WorkerPool, ModelRoutePool] = models.ManyToManyField(
        WorkerPool, through="ModelRoutePool", related_name="routes"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_pattern(self) -> bool:
        return any(c in self.name for c in "*?[")


class ModelRoutePool(models.Model):
    """One pool of a route, at its place in the preference order."""

    route = models.ForeignKey(ModelRoute, on_delete=models.CASCADE, related_name="route_pools")
    pool = models.ForeignKey(WorkerPool, on_delete=models.CASCADE, related_name="route_places")
    position = models.PositiveSmallIntegerField(default=0, help_text="Lower first.")

    class Meta:
        ordering = ["route", "position", "id"]
        constraints = [models.UniqueConstraint(fields=["route", "pool"], name="unique_pool_per_route")]

    def __str__(self) -> str:
        return f"{self.route.name} #{self.position}: {self.pool.name}"


class Outcome(models.TextChoices):
    SUCCESS = "success", "success"
    FAILURE = "failure", "failure"
    CANCELLED = "cancelled", "cancelled"
    ABANDONED = "abandoned", "abandoned"


class Reservation(models.Model):
    """Capacity the router held on an endpoint for one request's stage.

    `released_at` is set exactly once; a row with it empty is either in flight or was left by a
    gateway process that died (`gateway_instance`), which the next start-up closes as abandoned.
    """

    reservation_id = models.CharField(max_length=40, unique=True)
    request_id = models.CharField(max_length=64, db_index=True)
    # No database constraint: reservation rows are written in the background and must not fail
    # because an operator deleted the endpoint meanwhile; `endpoint_url` keeps the history.
    endpoint = models.ForeignKey(
        WorkerEndpoint,
        on_delete=models.DO_NOTHING,
        null=True,
        db_constraint=False,
        related_name="reservations",
    )
    endpoint_url = models.CharField(max_length=300, blank=True, default="")
    pool_name = models.CharField(max_length=100, blank=True, default="")
    stage = models.CharField(max_length=20, choices=Stage.choices)
    gateway_instance = models.CharField(max_length=64, blank=True, default="", db_index=True)
    reserved_at = models.DateTimeField(db_index=True)
    released_at = models.DateTimeField(null=True, blank=True, db_index=True)
    outcome = models.CharField(max_length=20, choices=Outcome.choices, blank=True, default="")

    class Meta:
        ordering = ["-reserved_at"]

    def __str__(self) -> str:
        return f"{self.request_id} {self.stage} @ {self.endpoint_url}"


class GatewayProcess(models.Model):
    """A running (or dead) gateway process, seen through its heartbeat.

    Rows a process leaves open when it dies (reservations, in-progress audit rows) are closed by
    the first live process that notices it is gone (see `workers.cluster.recovery`).
    """

    instance = models.CharField(max_length=64, unique=True)
    started_at = models.DateTimeField()
    last_seen_at = models.DateTimeField(db_index=True)
    recovered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-last_seen_at"]

    def __str__(self) -> str:
        return self.instance
