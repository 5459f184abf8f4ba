"""`manage.py quickstart`: what `make run` runs after migrating.

When no real worker is registered it starts a simulated context and generation worker and
registers them (pool `local-sim`, model `sim-model`, sharing a handoff signing key made for the
run); it rotates the `make-run` API key and prints
it with a ready-to-paste curl line; then it serves the gateway with daphne in this process. The
simulated workers stop when the gateway does.

It lives in `workers` because it starts the simulator; the API key belongs to the front door,
which `workers` never imports, so the key is made by that app's `create_api_key` command.
"""

from __future__ import annotations

import io
import secrets
import shlex
from typing import Any

from daphne.cli import CommandLineInterface
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers.management.commands.simworker import AUTH_KEY_ENV
from workers.models import ModelRoute, Role, WorkerEndpoint, WorkerPool
from workers.sim.process import SimWorker, start_simworker

SIM_POOL = "local-sim"
SIM_MODEL = "sim-model"
KEY_NAME = "make-run"
# Claude Code's model names (Opus, Sonnet and Haiku classes), routed to the simulated pool so
# that it needs no model variables: the exact current names are listed by /v1/models (its /model
# picker), and the patterns catch the others, the background Haiku-class calls included.
# (Current as of Claude Code 2.1.332, 2026-11; the patterns catch the names that come later.)
CLAUDE_MODELS = (
    ("claude-opus-5-5", "Claude Opus 5.5 (simulated)"),
    ("claude-sonnet-5-5", "Claude Sonnet 5.5 (simulated)"),
    ("claude-haiku-5-5", "Claude Haiku 5.5 (simulated)"),
    ("claude-opus-4-8", "Claude Opus 4.8 (simulated)"),
    ("claude-sonnet-4-6", "Claude Sonnet 4.6 (simulated)"),
    ("claude-haiku-4-5", "Claude Haiku 4.5 (simulated)"),
)
CLAUDE_PATTERNS = ("claude-opus-*", "claude-sonnet-*", "claude-haiku-*", "claude-*")


class Command(BaseCommand):
    help = "Serve the gateway on a fresh machine: simulated workers if none are registered, a key, daphne."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--context-port", type=int, default=8101, help="simulated context worker")
        parser.add_argument("--generation-port", type=int, default=8102, help="simulated generation worker")

    def handle(self, *args: Any, **options: Any) -> None:
        model = self._workers(options)
        key = self._rotate_key()
        base = f"http://{options['host']}:{options['port']}"
        body = '{"model":"%s","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"Hello!"}]}' % model
        self.stdout.write(
            "\nThe gateway is starting on %s\n\nAPI key (shown once): %s\n\nTry it:\n"
            "  curl -sN %s/v1/messages -H %s -H 'anthropic-version: 2023-06-01' "
            "-H 'content-type: application/json' -d %s\n\n"
            "Claude Code:\n  ANTHROPIC_BASE_URL=%s ANTHROPIC_API_KEY=%s claude\n"
            "  (its Claude model names are routed here; add CLAUDE_CODE_ENABLE_GATEWAY_MODEL_DISCOVERY=1 for the /model picker)\n\n"
            "Admin: %s/%s (create a user with `manage.py createsuperuser`)\n"
            % (base, key, base, shlex.quote(f"x-api-key: {key}"), shlex.quote(body), base, key, base, settings.ADMIN_URL)
        )
        self.stdout.flush()
        CommandLineInterface().run(["-b", options["host"], "-p", str(options["port"]), "disagg_project.asgi:application"])

    def _workers(self, options: dict[str, Any]) -> str:
        registered = WorkerEndpoint.objects.exclude(pool__name=SIM_POOL).first()
        if registered is not None:
            pool = registered.pool
            self.stdout.write(f"Using the registered workers (pool {pool.name}, model {pool.model}).")
            return pool.model
        # The simulated workers check signed handoffs as TensorRT-LLM's do: they and the pool share
        # a key made for this run (passed in their environment, not on their command line).
        signing_key = secrets.token_urlsafe(32)
        context = self._start("context", options["context_port"], signing_key)
        generation = self._start("generation", options["generation_port"], signing_key)
        pool, _ = WorkerPool.objects.get_or_create(name=SIM_POOL, defaults={"model": SIM_MODEL})
        pool.handoff_signing_key = signing_key
        pool.save(update_fields=["handoff_signing_key", "updated_at"])
        # The simulated workers may land on other ports than last time: register what runs now.
        pool.endpoints.all().delete()
        WorkerEndpoint.objects.create(pool=pool, role=Role.CONTEXT, url=context.url)
        WorkerEndpoint.objects.create(pool=pool, role=Role.GENERATION, url=generation.url)
        self.stdout.write(f"Started simulated workers: context {context.url}, generation {generation.url} (pool {SIM_POOL}).")
        self._route_claude_models()
        return pool.model

    def _route_claude_models(self) -> None:
        """Claude Code's names to the simulated pool, unless an operator routed them elsewhere."""
        for name, display_name in CLAUDE_MODELS:
            if not ModelRoute.objects.filter(name=name).exists():
                call_command("model_route", name, pool=[SIM_POOL], display_name=display_name, stdout=io.StringIO())
        for pattern in CLAUDE_PATTERNS:
            if not ModelRoute.objects.filter(name=pattern).exists():
                call_command("model_route", pattern, pool=[SIM_POOL], stdout=io.StringIO())

    def _start(self, role: str, port: int, signing_key: str) -> SimWorker:
        env = {AUTH_KEY_ENV: signing_key}
        try:
            return start_simworker(role, port=port, env=env)
        except RuntimeError:
            return start_simworker(role, port=0, env=env)  # the port is taken: any free one will do

    def _rotate_key(self) -> str:
        out = io.StringIO()
        # The key is the last line `create_api_key` prints (its note goes to stderr).
        call_command("create_api_key", KEY_NAME, replace=True, stdout=out, stderr=io.StringIO())
        lines = out.getvalue().split()
        if not lines:
            raise CommandError("create_api_key printed no key")
        return lines[-1]
