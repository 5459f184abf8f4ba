"""`manage.py model_route NAME_OR_PATTERN --pool POOL [--pool POOL2 ...] [--display-name TEXT] [--upstream-model NAME]`:
route a public model name (or pattern, e.g. `claude-sonnet-*`) to pools in preference order.

    manage.py model_route claude-sonnet-4-6 --pool big --pool spare --display-name "Sonnet (Qwen3 32B)"
    manage.py model_route 'claude-haiku-*' --pool small --upstream-model Qwen/Qwen3-8B
    manage.py model_route claude-sonnet-4-6 --delete
    manage.py model_route --list
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from disagg_project import log_change
from workers.models import ModelRoute, ModelRoutePool, WorkerPool


class Command(BaseCommand):
    help = "Route a public model name or pattern to pools in preference order (or list / delete routes)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", nargs="?", help='An exact name ("claude-sonnet-4-6") or a pattern ("claude-sonnet-*").')
        parser.add_argument("--pool", action="append", default=[], help="A pool serving it; repeat in preference order.")
        parser.add_argument("--display-name", help="Shown by /v1/models (Claude Code's /model picker).")
        parser.add_argument("--upstream-model", help="The model name sent to the workers (default: each pool's own).")
        parser.add_argument("--delete", action="store_true", help="Remove the route.")
        parser.add_argument("--list", action="store_true", help="Print every route.")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["list"]:
            for route in ModelRoute.objects.prefetch_related("route_pools__pool"):
                self.stdout.write(describe(route))
            return
        name = options["name"]
        if not name:
            raise CommandError("give a model name or pattern (or --list)")
        if options["delete"]:
            deleted, _ = ModelRoute.objects.filter(name=name).delete()
            if not deleted:
                raise CommandError(f"no route {name!r}")
            log_change("model_route --delete", "route %r deleted", name)
            self.stdout.write(f"deleted: {name}")
            return
        pools = []
        for pool_name in options["pool"]:
            pool = WorkerPool.objects.filter(name=pool_name).first()
            if pool is None:
                raise CommandError(f"no pool named {pool_name!r}")
            pools.append(pool)
        existing = ModelRoute.objects.filter(name=name).first()
        if existing is None and not pools:
            raise CommandError("a new route needs at least one --pool")
        before = describe(existing) if existing is not None else None
        with transaction.atomic():
            route = existing or ModelRoute(name=name)
            if options.get("display_name") is not None:
                route.display_name = options["display_name"]
            if options.get("upstream_model") is not None:
                route.upstream_model = options["upstream_model"]
            route.save()
            if pools:
                route.route_pools.all().delete()
                ModelRoutePool.objects.bulk_create(
                    ModelRoutePool(route=route, pool=pool, position=position) for position, pool in enumerate(pools)
                )
        after = describe(route)
        if before is None:
            log_change("model_route", "route created: %s", after)
        elif after != before:
            log_change("model_route", "route changed: %s → %s", before, after)
        self.stdout.write(after)


def describe(route: ModelRoute) -> str:
    pools = " > ".join(place.pool.name for place in route.route_pools.select_related("pool")) or "(no pool)"
    upstream = f" as {route.upstream_model}" if route.upstream_model else ""
    shown = f' "{route.display_name}"' if route.display_name else ""
    return f"{route.name}{shown}: {pools}{upstream}"
