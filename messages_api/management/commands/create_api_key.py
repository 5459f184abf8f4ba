from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from disagg_project import log_change
from messages_api.auth import create_api_key
from messages_api.models import ApiKey


class Command(BaseCommand):
    help = "Create an API key. The key is printed once, as the last line of stdout; only its hash is stored."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="A name for the key (unique), shown in the audit.")
        parser.add_argument("--replace", action="store_true", help="Delete a key of that name first (rotate it).")
        parser.add_argument(
            "--cache-group", metavar="NAME",
            help="Share the workers' prefix cache with the other keys of this group, where a pool keeps keys apart "
            "(with --replace: the replaced key's group unless given).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"]
        cache_group = options["cache_group"]
        if options["replace"]:
            for old in ApiKey.objects.filter(name=name):
                if cache_group is None:
                    cache_group = old.cache_group
                old.delete()
                log_change("create_api_key --replace", "API key %r (%s…) deleted", name, old.prefix)
        if ApiKey.objects.filter(name=name).exists():
            raise CommandError(f"an API key named {name!r} already exists")
        api_key, key = create_api_key(name, cache_group=cache_group or "")
        log_change(
            "create_api_key", "API key %r (id %d, %s…) created%s", api_key.name, api_key.pk, api_key.prefix,
            f" in cache group {api_key.cache_group!r}" if api_key.cache_group else "",
        )
        self.stderr.write(f"created API key {api_key.name!r} ({api_key.prefix}…); it is shown only now:")
        self.stdout.write(key)
