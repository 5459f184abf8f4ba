"""`manage.py key_limits NAME [--concurrency N] [--requests-per-minute N] ... [--priority P] [--models PATTERN ...]`:
set an API key's limits; 0 or `none` removes a limit; with no option, print them."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from disagg_project import limit_argument, log_change
from messages_api.models import ApiKey
from workers import Priority

# Option → the key's field.
LIMIT_OPTIONS = {
    "concurrency": "max_concurrency",
    "requests_per_minute": "requests_per_minute",
    "input_tokens_per_minute": "input_tokens_per_minute",
    "output_tokens_per_minute": "output_tokens_per_minute",
    "tokens_per_day": "tokens_per_day",
    "tokens_per_month": "tokens_per_month",
}


class Command(BaseCommand):
    help = "Set (or show) an API key's limits, priority and allowed models. 0 or `none` removes a limit."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The key's name.")
        for option in LIMIT_OPTIONS:
            parser.add_argument("--" + option.replace("_", "-"), type=limit_argument, metavar="N")
        parser.add_argument("--priority", choices=[p.label for p in Priority], help="The key's class when the cluster is full.")
        parser.add_argument(
            "--models", nargs="*", metavar="PATTERN",
            help="Model names or patterns (claude-sonnet-*) the key may use; `--models` alone (or `--models none`) allows every model.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        key = ApiKey.objects.filter(name=options["name"]).first()
        if key is None:
            raise CommandError(f"no API key named {options['name']!r}")
        changed: list[str] = []
        before = {field: getattr(key, field) for field in (*LIMIT_OPTIONS.values(), "priority", "allowed_models")}
        for option, field in LIMIT_OPTIONS.items():
            if options.get(option) is not None:
                setattr(key, field, options[option] or None)
                changed.append(field)
        if options.get("priority"):
            key.priority = options["priority"]
            changed.append("priority")
        if options.get("models") is not None:
            models = [m for m in options["models"] if m.lower() != "none"]
            key.allowed_models = models
            changed.append("allowed_models")
        if changed:
            key.save(update_fields=changed)
            differences = [f"{field} {before[field]!r} → {getattr(key, field)!r}" for field in changed if before[field] != getattr(key, field)]
            if differences:
                log_change("key_limits", "API key %r (id %d): %s", key.name, key.pk, ", ".join(differences))
        self.stdout.write(describe(key))


def describe(key: ApiKey) -> str:
    parts = [f"{key.name}: priority {key.priority}"]
    for option, field in LIMIT_OPTIONS.items():
        value = getattr(key, field)
        parts.append(f"{option.replace('_', ' ')} {value if value is not None else 'unlimited'}")
    parts.append("models " + (", ".join(key.allowed_models) if key.allowed_models else "all"))
    return "; ".join(parts)
