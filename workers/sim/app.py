"""The simulated worker's ASGI application: routing, stats and the sim-only routes.

Routes:
    GET  /health               {"status": "ok"}
    GET  /v1/models            the one model, with max_model_len
    GET  /server_info          what the dialect's engine reports there (404 where it has none)
    POST /v1/chat/completions  see chat.py
    POST /tokenize             vLLM's shape: {"count", "tokens", "max_model_len"}
    GET  /sim/stats            counters (stats.py) plus the handoff gauges
    POST /sim/reset            zeroes counters and the request log; held handoffs stay
    GET  /sim/requests         the last 200 chat request bodies, newest last (`?headers=1`:
                               {"body", "headers"} each, with the recorded headers)
    POST /sim/kv/take          context workers only: hand a KV handoff to a generation worker
    GET  /sim/prefix_cache     the prefix cache's size and counters (prefix_cache.py)
    POST /sim/prefix_cache/match   {"messages", "tools", "cache_salt"?} -> {"cached_tokens"}, without touching it
    GET  /sim/kv_events?after=N    stored/removed block hashes since event N (KV-event publisher)
    POST /sim/kv_events        {"mode": "live"|"drop"|"mute", "reset_prefix_cache"?, "restart"?}: the
                               ZeroMQ publisher's faults (--kv-events; kv_publisher.py)
    GET  /metrics              the engine's load in its Prometheus names (TensorRT-LLM's dialect:
                               /prometheus/metrics; none for the plain OpenAI one): engine_metrics.py
    POST /sim/outside_load     {"waiting", "running", "kv_usage"?, "metrics_status"?}: load the
                               metrics report beyond the sim's own (traffic from elsewhere)
    POST /sim/health           {"delay_s"}: /health answers that late from now on (0: at once),
                               while chat requests are served as before: an engine whose health
                               route waits behind its busy serving loop
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import orjson

from workers.kv_events.hashing import BlockHasher

from .asgi import (
    ClientDisconnected,
    Disconnected,
    Receive,
    Scope,
    Send,
    read_body,
    run_until_disconnect,
    send_error,
    send_json,
)
from .chat import ChatCompletions
from .config import SimConfig
from .engine_metrics import OutsideLoad, render
from .error_answers import SimError, SimulatedDrop
from .handoffs import HandoffStore
from .kv_publisher import MODES, KvPublisher
from .prefix_cache import PrefixCache
from .stats import Outcome, RequestLog, Stats
from .tokenizer import tokenize, tokenize_chat
from .transfer import TAKE_PATH, TAKE_STATUS_CODES, KvPuller

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


def public_url(config: SimConfig) -> str:
    """The address other processes reach this worker at (wildcard binds become loopback)."""
    host = config.host
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.port}"


async def _json_body(receive: Receive) -> Any:
    try:
        return orjson.loads(await read_body(receive))
    except orjson.JSONDecodeError:
        raise SimError(400, "request body is not valid JSON") from None


class SimApp:
    """One simulated worker. `config.port` must be the real, bound port."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.url = public_url(config)
        self.stats = Stats()
        self.log = RequestLog()
        self.handoffs = HandoffStore(config.kv_timeout)
        self.puller = KvPuller()
        self.kv_publisher: KvPublisher | None = None
        cache = None
        if config.kv_events_address:
            self.kv_publisher = KvPublisher(config.kv_events_address, config.kv_replay_address, buffer_steps=config.kv_buffer_steps)
            cache = PrefixCache(
                config.kv_block_tokens, config.kv_cache_blocks, BlockHasher(config.kv_hash_algorithm, config.kv_hash_seed),
                self.kv_publisher.publish,
            )
        self.chat = ChatCompletions(config, self.url, self.log, self.handoffs, self.puller, cache)
        self._models = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": config.model,
                        "object": "model",
                        "owned_by": "sim",
                        "max_model_len": config.max_context_tokens,
                    }
                ],
            }
        )
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._list_models,
            ("POST", "/v1/chat/completions"): self._chat_completions,
            ("POST", "/tokenize"): self._tokenize,
            ("GET", "/server_info"): self._server_info,
            ("GET", "/sim/stats"): self._stats,
            ("POST", "/sim/reset"): self._reset,
            ("GET", "/sim/requests"): self._requests,
            ("POST", TAKE_PATH): self._take,
            ("GET", "/sim/prefix_cache"): self._prefix_cache,
            ("POST", "/sim/prefix_cache/match"): self._prefix_match,
            ("GET", "/sim/kv_events"): self._kv_events,
            ("POST", "/sim/kv_events"): self._kv_events_control,
            ("POST", "/sim/health"): self._health_control,
        }
        self.health_delay_s = 0.0
        self.outside = OutsideLoad(config.outside_waiting, config.outside_running)
        self.metrics_reads = 0
        if self.chat.dialect.metrics is not None:
            self._routes[("GET", self.chat.dialect.metrics.path)] = self._metrics
            self._routes[("POST", "/sim/outside_load")] = self._outside_load
        self._paths = {path for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self._routes.get((scope["method"], scope["path"]))
            if handler is not None:
                try:
                    await handler(scope, receive, send)
                except ClientDisconnected:
                    pass
                except SimError as error:
                    await send_error(send, error)
            elif scope["path"] in self._paths:
                await send_error(send, SimError(405, "Method Not Allowed"))
            else:
                await send_error(send, SimError(404, f"Not Found: {scope['path']}"))
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.kv_publisher is not None:
                    self.kv_publisher.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.puller.aclose()
                if self.kv_publisher is not None:
                    await self.kv_publisher.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.stats.start()
        outcome = Outcome.FAILED
        try:
            try:
                body = await read_body(receive)
            except ClientDisconnected:
                outcome = Outcome.ABORTED
                return
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
            result = await run_until_disconnect(receive, self.chat.handle(body, send, headers))
            outcome = Outcome.ABORTED if isinstance(result, Disconnected) else result
        except SimulatedDrop:
            # Re-raised on purpose: uvicorn then closes the connection mid-body.
            outcome = Outcome.FAILED
            raise
        finally:
            self.stats.finish(outcome)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        await send_json(send, 200, {"status": "ok"})

    async def _health_control(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _json_body(receive)
        delay = body.get("delay_s") if isinstance(body, dict) else None
        if not isinstance(delay, (int, float)) or isinstance(delay, bool) or not 0 <= delay <= 3600:
            raise SimError(400, "delay_s must be a number of seconds between 0 and 3600")
        self.health_delay_s = float(delay)
        await send_json(send, 200, {"status": "ok"})

    async def _server_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        info = self.chat.dialect.server_info(self.config, self.url)
        if info is None:
            raise SimError(404, "Not Found: /server_info")
        await send_json(send, 200, info)

    async def _list_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, orjson.Fragment(self._models))

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _json_body(receive)
        if isinstance(body, dict) and isinstance(body.get("messages"), list):
            tokens = tokenize_chat(body["messages"], body.get("tools"))
        elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
            tokens = tokenize(body["prompt"])
        else:
            raise SimError(400, "tokenize needs either messages (a list) or prompt (a string)")
        await send_json(
            send,
            200,
            {"count": len(tokens), "tokens": tokens, "max_model_len": self.config.max_context_tokens},
        )

    async def _stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(
            send,
            200,
            {
                "role": self.config.role,
                "model": self.config.model,
                **self.stats.snapshot(),
                "kv_held": self.handoffs.held,
                "kv_taken": self.handoffs.taken,
                "kv_expired": self.handoffs.expired,
                "kv_waiting": self.handoffs.waiting,
                "metrics_reads": self.metrics_reads,
            },
        )

    async def _reset(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.stats.reset()
        self.metrics_reads = 0
        self.handoffs.reset_counters()
        self.log.clear()
        await send_json(send, 200, {"status": "ok"})

    async def _requests(self, scope: Scope, receive: Receive, send: Send) -> None:
        # `?headers=1`: each request as {"body", "headers"} (the recorded ones).
        with_headers = b"headers=1" in scope.get("query_string", b"").split(b"&")
        await send_json(send, 200, self.log.entries() if with_headers else self.log.bodies())

    async def _take(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _json_body(receive)
        if self.config.role != "context":
            raise SimError(404, "only a context worker holds KV handoffs")
        if not isinstance(body, dict):
            raise SimError(400, "take body must be a JSON object")
        handoff_id = body.get("ctx_request_id")
        state = body.get("encoded_opaque_state")
        wait_s = body.get("wait_s") or 0.0
        if not isinstance(handoff_id, int) or isinstance(handoff_id, bool):
            raise SimError(400, "ctx_request_id must be an integer")
        if state is not None and not isinstance(state, str):
            raise SimError(400, "encoded_opaque_state must be a string or null")
        if not isinstance(wait_s, (int, float)) or wait_s < 0:
            raise SimError(400, "wait_s must be a non-negative number")
        # A generation-first take can wait a long time: if its caller goes, stop waiting.
        result = await run_until_disconnect(
            receive, self.handoffs.take(handoff_id, state, float(wait_s))
        )
        if isinstance(result, Disconnected):
            return
        answer: dict[str, Any] = {
            "status": result.status,
            "message": result.message,
            "ctx_request_id": handoff_id,
        }
        if result.handoff is not None:
            answer["prompt_tokens"] = result.handoff.prompt_tokens
            answer["first_gen_tokens"] = result.handoff.first_gen_tokens
        await send_json(send, TAKE_STATUS_CODES[result.status], answer)

    async def _prefix_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.chat.cache.snapshot())

    async def _prefix_match(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _json_body(receive)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise SimError(400, "match needs messages (a list)")
        tokens = tokenize_chat(body["messages"], body.get("tools"))
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        cached = self.chat.cache.match(tokens, touch=False, salt=salt)
        await send_json(send, 200, {"cached_tokens": cached, "prompt_tokens": len(tokens)})

    async def _kv_events(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        try:
            after = int(query.get("after", ["0"])[0])
        except ValueError:
            raise SimError(400, "after must be an integer") from None
        await send_json(send, 200, self.chat.cache.events_after(after))

    async def _kv_events_control(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _json_body(receive)
        publisher = self.kv_publisher
        if publisher is None:
            raise SimError(404, "this worker publishes no KV-cache events (--kv-events)")
        if not isinstance(body, dict):
            raise SimError(400, "kv_events needs a JSON object")
        mode = body.get("mode", publisher.mode)
        if mode not in MODES:
            raise SimError(400, f"mode must be one of {', '.join(MODES)}")
        publisher.mode = mode
        if body.get("reset_prefix_cache"):
            self.chat.cache.clear()
        if body.get("restart"):
            self.chat.cache.clear(restart=True)
            publisher.restart()
        await send_json(send, 200, {"mode": publisher.mode, "published": publisher.published})

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics_reads += 1
        names = self.chat.dialect.metrics
        assert names is not None  # routed only for a dialect with metrics
        outside = self.outside
        if outside.metrics_status != 200:
            raise SimError(outside.metrics_status, "metrics unavailable")
        cache = self.chat.cache
        kv = cache.blocks_held / cache.capacity_blocks if cache.enabled else 0.0
        if outside.kv_usage is not None:
            kv = max(kv, outside.kv_usage)
        queued = self.chat.queued
        body = render(
            names, self.config.model, waiting=queued + outside.waiting,
            running=max(0, self.stats.active - queued) + outside.running, kv_usage=kv,
        )
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"), (b"content-length", str(len(body)).encode()),
        ]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async def _outside_load(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _json_body(receive)
        if not isinstance(body, dict):
            raise SimError(400, "outside_load needs a JSON object")
        counts = {k: body.get(k, 0) for k in ("waiting", "running")}
        if any(type(v) is not int or v < 0 for v in counts.values()):
            raise SimError(400, "waiting and running must be non-negative integers")
        kv = body.get("kv_usage")
        if kv is not None and (not isinstance(kv, (int, float)) or not 0 <= kv <= 1):
            raise SimError(400, "kv_usage must be a fraction between 0 and 1")
        status = body.get("metrics_status", 200)
        if type(status) is not int or not (status == 200 or 400 <= status <= 599):
            raise SimError(400, "metrics_status must be 200 or an error status")
        self.outside = OutsideLoad(counts["waiting"], counts["running"], None if kv is None else float(kv), status)
        await send_json(send, 200, {"status": "ok"})
