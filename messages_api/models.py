"""What the Anthropic front door keeps: API keys (hashed), an audit row per request, and Message
Batches with their items (messages_api/batches/)."""

from __future__ import annotations

from django.db import models

from workers import Priority


class ApiKey(models.Model):
    """A client credential. Only a SHA-256 hash of the key is stored; the key is shown once."""

    name = models.CharField(max_length=100, unique=True)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=16, editable=False, help_text="Shown to tell keys apart.")
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    # --- limits (messages_api/limits/): empty means no such limit -----------------------------
    # The admission class (`workers.Priority`), stored by its label.
    priority = models.CharField(
        max_length=20, choices=Priority.choices(), default=Priority.STANDARD.label,
        help_text="The key's class when the cluster is full: interactive requests go before standard, standard before batch.",
    )
    max_concurrency = models.PositiveIntegerField(null=True, blank=True, help_text="Requests in flight at once.")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    input_tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    output_tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_day = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Input + output tokens per UTC day; at the budget the key is refused until the day turns."
    )
    tokens_per_month = models.PositiveBigIntegerField(null=True, blank=True, help_text="Input + output tokens per UTC month.")
    allowed_models = models.JSONField(
        default=list, blank=True,
        help_text='Model names the key may use: exact, or patterns such as "claude-sonnet-*". Empty: every model.',
    )
    # Pools whose cache scope is per key (workers.models.CacheScope.KEY) give each key its own
    # prefix cache; keys with the same group share one (a team's keys reuse each other's prompts).
    cache_group = models.CharField(
        max_length=100, blank=True, default="",
        help_text="Keys with the same cache group share the workers' prefix cache where a pool keeps keys apart "
        "(and can tell whether another of the group sent a prompt). Empty: the key's cache is its own.",
    )

    class Meta:
        verbose_name = "API key"
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"


class RequestStatus(models.TextChoices):
    IN_PROGRESS = "in_progress", "in progress"
    COMPLETED = "completed", "completed"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"
    REJECTED = "rejected", "rejected"


class MessageRequest(models.Model):
    """The audit row of one `POST /v1/messages` request, and of every rejected or failed request
    to the other API routes (`route` tells them apart).

    A request is `rejected` when the client's request was refused before any worker was asked
    (auth, validation, unknown model, method, size), `failed` when a worker or the gateway failed
    it (or it outlived its deadline), `cancelled` when the client left.
    Timings are milliseconds since `received_at`.
    """

    request_id = models.CharField(max_length=64, unique=True)
    received_at = models.DateTimeField(db_index=True)
    route = models.CharField(max_length=200, blank=True, default="", help_text="Method and path.")
    model = models.CharField(max_length=200, blank=True, default="", db_index=True)
    stream = models.BooleanField(default=False)
    status = models.CharField(
        max_length=20, choices=RequestStatus.choices, default=RequestStatus.IN_PROGRESS, db_index=True
    )
    stage = models.CharField(max_length=20, blank=True, default="", db_index=True)
    http_status = models.PositiveSmallIntegerField(null=True, blank=True)
    error_type = models.CharField(max_length=40, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    pool_name = models.CharField(max_length=100, blank=True, default="", db_index=True)
    context_endpoint = models.CharField(max_length=300, blank=True, default="", db_index=True)
    generation_endpoint = models.CharField(max_length=300, blank=True, default="", db_index=True)
    headers_sent_ms = models.FloatField(null=True, blank=True)
    context_done_ms = models.FloatField(null=True, blank=True)
    first_token_ms = models.FloatField(null=True, blank=True)
    finished_ms = models.FloatField(null=True, blank=True)
    pings_sent = models.PositiveIntegerField(default=0)
    input_tokens = models.PositiveIntegerField(null=True, blank=True)
    output_tokens = models.PositiveIntegerField(null=True, blank=True)
    cache_read_input_tokens = models.PositiveIntegerField(null=True, blank=True, help_text="Prompt tokens read from the worker's prefix cache.")
    cache_creation_input_tokens = models.PositiveIntegerField(
        null=True, blank=True, help_text="Prompt tokens up to the last cache_control breakpoint the worker did not hold (written to its cache)."
    )
    api_key_name = models.CharField(max_length=100, blank=True, default="", help_text="The key's name when the request was made.")
    # The key itself, whatever it is renamed to later. No database constraint, as the reservations'
    # endpoint: rows are written in the background, and a key deleted meanwhile must not fail the
    # write; deleting a key empties the field of its rows (the name stays).
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, db_constraint=False, related_name="requests",
    )
    queued_ms = models.FloatField(null=True, blank=True, help_text="Time spent in the admission queue waiting for worker capacity.")
    gateway_instance = models.CharField(max_length=64, blank=True, default="", db_index=True)
    # A Message Batch item's attempt: the batch's id and the item's custom_id (empty otherwise).
    # Database defaults too: the row writer inserts the columns it is given.
    batch_id = models.CharField(max_length=64, blank=True, default="", db_default="", db_index=True)
    custom_id = models.CharField(max_length=64, blank=True, default="", db_default="")
    # The request's OpenTelemetry trace (32 hex digits) when it was sampled, else empty; the admin
    # links it through TRACE_URL_TEMPLATE.
    trace_id = models.CharField(max_length=32, blank=True, default="", db_default="")

    class Meta:
        verbose_name = "message request"
        ordering = ["-received_at"]

    def __str__(self) -> str:
        return f"{self.request_id} {self.status}"


class KeyUsage(models.Model):
    """One API key's use in one UTC hour, added to by every gateway process (messages_api/usage.py).

    Days are not stored: a day is the sum of its hours (messages_api/usage_report.py), so there is
    one source of truth and an increment that arrives late still counts. `prune_audit` deletes
    hours older than USAGE_HOURS_RETENTION_DAYS.
    """

    # No database constraint, like every row written in the background: its insert must take no
    # lock on the keys table (a PostgreSQL test run deadlocked a TRUNCATE against the flush's key
    # check). Deleting a key still deletes its usage (Django cascades).
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, db_constraint=False, related_name="usage")
    hour = models.DateTimeField(help_text="Start of the UTC hour the requests were received in.")
    requests = models.PositiveBigIntegerField(default=0)
    input_tokens = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    cache_read_tokens = models.PositiveBigIntegerField(default=0)
    errors = models.JSONField(default=dict, blank=True, help_text="Error type → requests that ended with it.")
    queued_ms_total = models.FloatField(default=0.0, help_text="Time the hour's requests spent in the admission queue, summed.")
    # The part of the above that Message Batch items were (their attempts, each a request).
    batch_requests = models.PositiveBigIntegerField(default=0, db_default=0)
    batch_input_tokens = models.PositiveBigIntegerField(default=0, db_default=0)
    batch_output_tokens = models.PositiveBigIntegerField(default=0, db_default=0)

    class Meta:
        verbose_name = "key usage (hour)"
        verbose_name_plural = "key usage (hours)"
        ordering = ["-hour"]
        constraints = [models.UniqueConstraint(fields=["api_key", "hour"], name="key_usage_one_row_per_key_and_hour")]
        indexes = [models.Index(fields=["hour"], name="key_usage_hour")]

    def __str__(self) -> str:
        return f"{self.api_key_id} {self.hour:%Y-%m-%d %H}:00"


class BatchStatus(models.TextChoices):
    """A batch's `processing_status`, Anthropic's three values."""

    IN_PROGRESS = "in_progress", "in progress"
    CANCELING = "canceling", "canceling"
    ENDED = "ended", "ended"


class MessageBatch(models.Model):
    """A Message Batch (`POST /v1/messages/batches`): it belongs to the key that created it.

    The counts are written once, when the batch ends (Anthropic's documented semantics: every
    request counts as `processing` until then); while it runs they are read from its items.
    The primary key orders the list (newest first); `batch_id` is the public `msgbatch_…` id.
    """

    batch_id = models.CharField(max_length=64, unique=True)
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="batches")
    api_key_name = models.CharField(max_length=100, blank=True, default="", help_text="The key's name when the batch was created.")
    processing_status = models.CharField(max_length=20, choices=BatchStatus.choices, default=BatchStatus.IN_PROGRESS, db_index=True)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    cancel_initiated_at = models.DateTimeField(null=True, blank=True)
    archived_at = models.DateTimeField(null=True, blank=True)
    total = models.PositiveIntegerField(default=0)
    succeeded = models.PositiveIntegerField(default=0)
    errored = models.PositiveIntegerField(default=0)
    canceled = models.PositiveIntegerField(default=0)
    expired = models.PositiveIntegerField(default=0)
    # The W3C traceparent of the request that created the batch, when it was traced: each item's
    # trace links to it (messages_api/request_span.py).
    traceparent = models.CharField(max_length=55, blank=True, default="", db_default="")

    class Meta:
        verbose_name = "message batch"
        verbose_name_plural = "message batches"
        ordering = ["-id"]
        indexes = [models.Index(fields=["api_key", "-id"], name="batch_key_newest_first")]

    def __str__(self) -> str:
        return self.batch_id


class ItemState(models.TextChoices):
    """Where an item is: waiting to be claimed, held by a process's lease, or done (its result written)."""

    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    DONE = "done", "done"


class ResultType(models.TextChoices):
    SUCCEEDED = "succeeded", "succeeded"
    ERRORED = "errored", "errored"
    CANCELED = "canceled", "canceled"
    EXPIRED = "expired", "expired"


class BatchItem(models.Model):
    """One request of a batch: its params as sent, its lease while a process runs it, its result.

    A process claims a queued item by setting `claimed_by` (its instance) and `lease_until`, and
    adding one to `attempts`; only that claim (`claimed_by` and `attempts` both matching, the item
    still running) may write the result, so a process that lost its lease never overwrites
    another's. `result` is the JSON of the results line's `result` object, written once.
    """

    batch = models.ForeignKey(MessageBatch, on_delete=models.CASCADE, related_name="items")
    position = models.PositiveIntegerField(help_text="The item's index in the create request.")
    custom_id = models.CharField(max_length=64)
    params = models.TextField(help_text="The item's Messages request, JSON as sent.")
    state = models.CharField(max_length=10, choices=ItemState.choices, default=ItemState.QUEUED)
    not_before = models.DateTimeField(help_text="Not claimed before this time (a retry's backoff).")
    claimed_by = models.CharField(max_length=64, blank=True, default="", db_index=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    request_id = models.CharField(max_length=64, blank=True, default="", help_text="The audit row of the last attempt.")
    result_type = models.CharField(max_length=10, choices=ResultType.choices, blank=True, default="")
    result = models.TextField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "batch item"
        constraints = [models.UniqueConstraint(fields=["batch", "custom_id"], name="batch_item_custom_id_unique")]
        indexes = [
            models.Index(fields=["state", "not_before"], name="batch_item_claimable"),
            models.Index(fields=["batch", "state"], name="batch_item_by_state"),
        ]

    def __str__(self) -> str:
        return f"{self.batch_id}/{self.custom_id}"
