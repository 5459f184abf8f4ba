from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.validators import URLValidator

from disagg_project import limit_argument, log_change
from workers import protocols
from workers.models import (
    CacheScope,
    KvHashAlgorithm,
    Role,
    RoutingPolicy,
    ScheduleStyle,
    WorkerEndpoint,
    WorkerPool,
)

# The KV-event flags (argparse's dest) and the endpoint fields they set.
_KV_FIELDS = {
    "kv_events": "kv_events_address",
    "kv_events_replay": "kv_events_replay_address",
    "kv_events_topic": "kv_events_topic",
    "kv_block_size": "kv_block_size",
    "kv_hash_algorithm": "kv_hash_algorithm",
    "kv_hash_seed": "kv_hash_seed",
}


class Command(BaseCommand):
    help = (
        "Register a worker endpoint in a pool (created if needed). Running it twice changes nothing. "
        "Every gateway process picks the change up within REGISTRY_REFRESH_INTERVAL_S."
    )
    # The system checks include the pools' protocol check (workers.E001): this command is how an
    # operator fixes a pool it flags, so it must not refuse to run because of one. It validates
    # the pool it writes itself.
    requires_system_checks: list[str] = []
    # `call_command(..., stdin=...)` feeds `--signing-key-file -`.
    stealth_options = ("stdin",)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--pool", required=True, help="Pool name (created if missing).")
        parser.add_argument("--model", required=True, help="The request `model` the pool serves.")
        parser.add_argument("--role", required=True, choices=Role.values)
        parser.add_argument("--url", required=True, help="Worker base URL, e.g. http://10.0.0.5:8001")
        parser.add_argument(
            "--protocol", choices=sorted(protocols.PROTOCOLS), help="Set the protocol the pool's workers speak."
        )
        parser.add_argument("--schedule-style", choices=ScheduleStyle.values, help="Set the pool's schedule style.")
        parser.add_argument("--routing", choices=RoutingPolicy.values, help="Set the pool's routing policy.")
        parser.add_argument(
            "--max-local-prefill-tokens", type=int, help="Set the pool's conditional disaggregation threshold."
        )
        parser.add_argument(
            "--cache-scope", choices=CacheScope.values,
            help="Set whose prompts a request may reuse from the workers' prefix caches: each key's own "
            "(or its cache group's; the default), or every key's.",
        )
        # A file, not a value: an argument shows in the process list and the shell's history.
        key = parser.add_mutually_exclusive_group()
        key.add_argument(
            "--signing-key-file",
            type=Path,
            metavar="PATH",
            help="Set the pool's handoff signing key (TensorRT-LLM's internal_request_auth_key, shared "
            "with its workers) to the first line of this file ('-': standard input).",
        )
        key.add_argument("--clear-signing-key", action="store_true", help="Remove the pool's handoff signing key.")
        parser.add_argument(
            "--capacity", type=limit_argument, metavar="N",
            help="Most requests in flight at once on this endpoint, across every gateway process (0 or none: unlimited).",
        )
        parser.add_argument(
            "--capacity-tokens", type=limit_argument, metavar="N",
            help="Most tokens (prompt + max_tokens) in flight at once on this endpoint (0 or none: unlimited).",
        )
        parser.add_argument(
            "--option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="Set one of the endpoint's protocol options (repeatable; VALUE is JSON, else a string), "
            "e.g. --option bootstrap_port=8998 for an SGLang prefill server. KEY= removes it.",
        )
        # The engine's KV-cache events (docs/engines.md): each flag sets one field of the endpoint;
        # an empty value clears it (the hash algorithm: "none" stops checking and scoring).
        kv = parser.add_argument_group("KV-cache events (the engine's --kv-events-config)")
        kv.add_argument("--kv-events", metavar="ADDRESS", help="The engine's publisher, e.g. tcp://10.0.0.5:5557 ('': stop following it).")
        kv.add_argument("--kv-events-replay", metavar="ADDRESS", help="Its replay socket, e.g. tcp://10.0.0.5:5558 ('': none).")
        kv.add_argument("--kv-events-topic", metavar="TOPIC", help="The publisher's topic ('': every topic).")
        kv.add_argument("--kv-block-size", type=limit_argument, metavar="N", help="The engine's KV block size in tokens (0 or none: 16).")
        kv.add_argument(
            "--kv-hash-algorithm", choices=[a or "none" for a in KvHashAlgorithm.values],
            help="The engine's --prefix-caching-hash-algo; 'tokens' for an engine whose hashes the gateway does not "
            "reproduce (SGLang, TensorRT-LLM); 'none': followed, not routed on.",
        )
        kv.add_argument("--kv-hash-seed", metavar="SEED", help="The engine's PYTHONHASHSEED, if it sets one ('': vLLM's default seed).")

    def handle(self, *args: Any, **options: Any) -> None:
        url = options["url"].rstrip("/")
        try:
            URLValidator(schemes=["http", "https"])(url)
        except ValidationError:
            raise CommandError(f"--url {url!r} is not an http(s) URL") from None
        pool = WorkerPool.objects.filter(name=options["pool"]).first()
        created = pool is None
        if pool is None:
            pool = WorkerPool(name=options["pool"], model=options["model"])
        elif pool.model != options["model"]:
            raise CommandError(
                f"pool {pool.name!r} serves model {pool.model!r}, not {options['model']!r}"
            )
        changed = created
        changes: list[str] = []  # for the change log: never the signing key itself
        for option, field in (
            ("protocol", "protocol"),
            ("schedule_style", "schedule_style"),
            ("routing", "routing"),
            ("max_local_prefill_tokens", "max_local_prefill_tokens"),
            ("cache_scope", "cache_scope"),
        ):
            if options.get(option) is not None and getattr(pool, field) != options[option]:
                changes.append(f"{field} {getattr(pool, field)!r} → {options[option]!r}")
                setattr(pool, field, options[option])
                changed = True
        signing_key = self._signing_key(options)
        if signing_key is not None and pool.handoff_signing_key != signing_key:
            changes.append("handoff signing key " + ("set" if signing_key else "cleared"))
            pool.handoff_signing_key = signing_key
            changed = True
        problem = protocols.misconfiguration(pool.protocol, pool.schedule_style, pool.max_local_prefill_tokens)
        if problem is not None:
            raise CommandError(f"pool {pool.name!r}: {problem}")
        if changed:
            pool.save()
            what = "created" if created else "changed"
            log_change("register_worker", "pool %r (model %r) %s%s", pool.name, pool.model, what, f": {', '.join(changes)}" if changes else "")
        endpoint_options = self._endpoint_options(options["option"])
        endpoint, endpoint_created = WorkerEndpoint.objects.get_or_create(pool=pool, role=options["role"], url=url)
        if endpoint_created:
            log_change("register_worker", "pool %r: %s endpoint %s added", pool.name, endpoint.role, endpoint.url)
        before = {"capacity": endpoint.capacity, "capacity_tokens": endpoint.capacity_tokens, "options": dict(endpoint.options)}
        before.update({field: getattr(endpoint, field) for field in _KV_FIELDS.values()})
        for field in ("capacity", "capacity_tokens"):
            if options.get(field) is not None:
                value = options[field] or None  # 0: unlimited
                if getattr(endpoint, field) != value:
                    setattr(endpoint, field, value)
                    endpoint.save(update_fields=[field, "updated_at"])
                    endpoint_created = True  # reported as a change
        if endpoint_options:
            merged = {**endpoint.options, **endpoint_options}
            merged = {k: v for k, v in merged.items() if v is not None}
            if merged != endpoint.options:
                endpoint.options = merged
                endpoint.save(update_fields=["options", "updated_at"])
                endpoint_created = True  # reported as a change
        if self._set_kv_events(endpoint, options):
            endpoint_created = True  # reported as a change
        after = {"capacity": endpoint.capacity, "capacity_tokens": endpoint.capacity_tokens, "options": endpoint.options}
        after.update({field: getattr(endpoint, field) for field in _KV_FIELDS.values()})
        if after != before:
            log_change(
                "register_worker", "pool %r: %s endpoint %s: %s", pool.name, endpoint.role, endpoint.url,
                ", ".join(f"{field} {before[field]!r} → {value!r}" for field, value in after.items() if before[field] != value),
            )
        verb = "registered" if endpoint_created else "already registered"
        capacity = "".join(
            f", {label} {value}" for label, value in (("capacity", endpoint.capacity), ("capacity tokens", endpoint.capacity_tokens)) if value
        )
        self.stdout.write(f"{verb}: pool {pool.name} ({pool.model}) {endpoint.role} {endpoint.url}{capacity}")

    @staticmethod
    def _set_kv_events(endpoint: WorkerEndpoint, options: dict[str, Any]) -> bool:
        """Set the KV-event fields the flags name, checked as the admin checks them (the model's
        `clean()`: no bind address, a port, a replay address only with the publisher's); whether
        anything changed."""
        values: dict[str, Any] = {}
        for option, field in _KV_FIELDS.items():
            value = options.get(option)
            if value is None:
                continue
            if option == "kv_hash_algorithm" and value == "none":
                value = ""
            elif option == "kv_block_size":
                value = value or None  # 0: the default
            values[field] = value
        if all(getattr(endpoint, field) == value for field, value in values.items()):
            return False
        for field, value in values.items():
            setattr(endpoint, field, value)
        try:
            endpoint.clean()
        except ValidationError as exc:
            flags = {field: option for option, field in _KV_FIELDS.items()}
            raise CommandError(
                "; ".join(f"--{flags.get(f, f).replace('_', '-')}: {' '.join(m)}" for f, m in exc.message_dict.items())
            ) from None
        endpoint.save(update_fields=[*values, "updated_at"])
        return True

    @staticmethod
    def _endpoint_options(pairs: list[str]) -> dict[str, Any]:
        """`KEY=VALUE` pairs; VALUE read as JSON (8998 is a number) or else kept as a string;
        an empty VALUE (None) removes the key."""
        parsed: dict[str, Any] = {}
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            if not sep or not key.strip():
                raise CommandError(f"--option {pair!r}: expected KEY=VALUE")
            try:
                value = json.loads(raw) if raw else None
            except json.JSONDecodeError:
                value = raw
            parsed[key.strip()] = value
        return parsed

    def _signing_key(self, options: dict[str, Any]) -> str | None:
        """The key to set ("" clears it), or None to leave the pool's as it is."""
        if options.get("clear_signing_key"):
            return ""
        path: Path | None = options.get("signing_key_file")
        if path is None:
            return None
        try:
            stdin = options.get("stdin") or sys.stdin
            text = stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            # The error names the file, never its content.
            raise CommandError(f"--signing-key-file {path}: cannot read it ({type(exc).__name__})") from None
        lines = text.splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise CommandError(f"--signing-key-file {path}: the first line is empty (use --clear-signing-key to remove the key)")
        max_length = WorkerPool._meta.get_field("handoff_signing_key").max_length or 256
        if len(key) > max_length:
            raise CommandError(f"--signing-key-file {path}: the key is longer than {max_length} characters")
        return key
