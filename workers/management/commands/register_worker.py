from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.validators import URLValidator

from workers import protocols
from workers.models import (
    Role,
    RoutingPolicy,
    ScheduleStyle,
    WorkerEndpoint,
    WorkerPool,
)


class Command(BaseCommand):
    help = (
        "Register a worker endpoint in a pool (created if needed). Running it twice changes nothing. "
        "Every gateway process picks the change up within REGISTRY_REFRESH_INTERVAL_S."
    )
    # The system checks include the pools' protocol check (workers.E001): this command is how an
    # operator fixes a pool it flags, so it must not refuse to run because of one. It validates
    # the pool it writes itself.
    requires_system_checks: list[str] = []

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
        for option, field in (
            ("protocol", "protocol"),
            ("schedule_style", "schedule_style"),
            ("routing", "routing"),
            ("max_local_prefill_tokens", "max_local_prefill_tokens"),
        ):
            if options.get(option) is not None and getattr(pool, field) != options[option]:
                setattr(pool, field, options[option])
                changed = True
        problem = protocols.misconfiguration(pool.protocol, pool.schedule_style)
        if problem is not None:
            raise CommandError(f"pool {pool.name!r}: {problem}")
        if changed:
            pool.save()
        endpoint, endpoint_created = WorkerEndpoint.objects.get_or_create(pool=pool, role=options["role"], url=url)
        verb = "registered" if endpoint_created else "already registered"
        self.stdout.write(f"{verb}: pool {pool.name} ({pool.model}) {endpoint.role} {endpoint.url}")
