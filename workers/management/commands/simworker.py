"""`manage.py simworker`: run one simulated worker (TensorRT-LLM, vLLM, SGLang or plain OpenAI) in this process."""

from __future__ import annotations

import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers.sim import ROLES, SimConfig, dialects, serve

# Named after TensorRT-LLM's `internal_request_auth_key` (its workers read it from their config).
AUTH_KEY_ENV = "INTERNAL_REQUEST_AUTH_KEY"


class Command(BaseCommand):
    help = "Run a simulated context or generation worker in one engine dialect (a real HTTP server)."
    # It touches neither the database nor the models; skip the checks to start fast.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--role", required=True, choices=ROLES)
        parser.add_argument("--port", required=True, type=int, help="0 picks a free port")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--max-context-tokens", type=int, default=131072)
        parser.add_argument(
            "--tokens-per-second", type=float, default=200.0, help="0 streams unpaced"
        )
        parser.add_argument("--prefill-tokens-per-second", type=float, default=50000.0)
        parser.add_argument(
            "--kv-timeout", type=float, default=60.0,
            help="seconds a handoff is held untaken, and a generation-first take waits",
        )
        parser.add_argument("--model", default="sim-model")
        parser.add_argument(
            "--protocol", default=dialects.DEFAULT, choices=dialects.names(),
            help="the engine dialect of disaggregated requests",
        )
        parser.add_argument(
            "--auth-key-env", default=AUTH_KEY_ENV, metavar="NAME",
            help="the environment variable holding the key signed handoffs are checked with "
            "(TensorRT-LLM's internal_request_auth_key; read from the environment so it is not "
            f"in the process list; unset or empty: none is checked). Default {AUTH_KEY_ENV}",
        )
        parser.add_argument("--kv-block-tokens", type=int, default=16, help="tokens per prefix-cache block")
        parser.add_argument(
            "--kv-cache-blocks", type=int, default=0,
            help="prefix-cache capacity in blocks (LRU); 0 disables the cache",
        )
        parser.add_argument(
            "--local-prefill-tokens-per-second", type=float, default=None,
            help="prefill rate of requests without a context phase (default: --prefill-tokens-per-second)",
        )
        parser.add_argument(
            "--prefill-concurrency", type=int, default=0,
            help="prefills computed at once (others queue); 0 is unlimited",
        )
        parser.add_argument(
            "--outside-waiting", type=int, default=0,
            help="requests its metrics report queued beyond its own (traffic from elsewhere)",
        )
        parser.add_argument("--outside-running", type=int, default=0, help="likewise, running")
        parser.add_argument("--kv-events", default="", help="publish KV-cache events on vLLM's wire, bound here (tcp://127.0.0.1:5557)")
        parser.add_argument("--kv-events-replay", default="", help="the replay socket's bind address")
        parser.add_argument("--kv-hash-algo", default="sha256", choices=["sha256", "sha256_cbor"], help="block hashes as vLLM's")
        parser.add_argument("--kv-hash-seed", default=None, help="the engine's PYTHONHASHSEED (default: vLLM's fixed seed)")
        parser.add_argument("--kv-buffer-steps", type=int, default=10000, help="batches kept for replay")

    def handle(self, *args: Any, **options: Any) -> None:
        if not 0 <= options["port"] <= 65535:
            raise CommandError("--port must be between 0 and 65535")
        for name in ("tokens_per_second", "prefill_tokens_per_second", "kv_timeout"):
            if options[name] < 0:
                raise CommandError(f"--{name.replace('_', '-')} must not be negative")
        if (options["local_prefill_tokens_per_second"] or 0) < 0:
            raise CommandError("--local-prefill-tokens-per-second must not be negative")
        if options["kv_block_tokens"] < 1:
            raise CommandError("--kv-block-tokens must be at least 1")
        for name in ("kv_cache_blocks", "prefill_concurrency", "outside_waiting", "outside_running"):
            if options[name] < 0:
                raise CommandError(f"--{name.replace('_', '-')} must not be negative")
        if options["kv_buffer_steps"] < 1:
            raise CommandError("--kv-buffer-steps must be at least 1")
        if options["kv_events_replay"] and not options["kv_events"]:
            raise CommandError("--kv-events-replay needs --kv-events")
        if options["max_context_tokens"] < 1:
            raise CommandError("--max-context-tokens must be at least 1")
        config = SimConfig(
            role=options["role"],
            host=options["host"],
            port=options["port"],
            model=options["model"],
            max_context_tokens=options["max_context_tokens"],
            tokens_per_second=options["tokens_per_second"],
            prefill_tokens_per_second=options["prefill_tokens_per_second"],
            kv_timeout=options["kv_timeout"],
            protocol=options["protocol"],
            internal_request_auth_key=os.environ.get(options["auth_key_env"], ""),
            kv_block_tokens=options["kv_block_tokens"],
            kv_cache_blocks=options["kv_cache_blocks"],
            local_prefill_tokens_per_second=options["local_prefill_tokens_per_second"],
            prefill_concurrency=options["prefill_concurrency"],
            outside_waiting=options["outside_waiting"],
            outside_running=options["outside_running"],
            kv_events_address=options["kv_events"],
            kv_replay_address=options["kv_events_replay"],
            kv_hash_algorithm=options["kv_hash_algo"],
            kv_hash_seed=options["kv_hash_seed"],
            kv_buffer_steps=options["kv_buffer_steps"],
        )

        def announce(line: str) -> None:
            self.stdout.write(line)
            self.stdout.flush()

        try:
            serve(config, announce)
        except OSError as exc:
            raise CommandError(f"cannot listen on {options['host']}:{options['port']}: {exc}") from exc
