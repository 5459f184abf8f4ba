"""/v1/chat/completions: the context-only, generation-only and aggregated paths."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import orjson

from . import dialects
from .asgi import Send, send_bytes, send_error
from .config import SimConfig
from .dialects import ContextIssue
from .emit import EmitOptions, respond, stream
from .error_answers import SimError, context_length_exceeded
from .handoffs import HandoffStore
from .output import plan_generation, prompt_seed
from .prefix_cache import PrefixCache
from .schema import ChatRequest, parse_chat_request
from .stats import Outcome, RequestLog
from .tokenizer import VOCAB_SIZE, tokenize_chat
from .transfer import KvPuller


class ChatCompletions:
    """Answers one chat request; run it under `run_until_disconnect` so aborts cancel it."""

    def __init__(
        self,
        config: SimConfig,
        public_url: str,
        log: RequestLog,
        handoffs: HandoffStore,
        puller: KvPuller,
        cache: PrefixCache | None = None,
    ) -> None:
        self.config = config
        self.cache = cache if cache is not None else PrefixCache(config.kv_block_tokens, config.kv_cache_blocks)
        # One accelerator: at most `prefill_concurrency` prefills compute at once.
        self._prefill_slots = (
            asyncio.Semaphore(config.prefill_concurrency) if config.prefill_concurrency > 0 else None
        )
        self.public_url = public_url
        self.log = log
        self.handoffs = handoffs
        self.puller = puller
        self.dialect = dialects.get(config.protocol)
        #: Requests waiting for a prefill slot (the engine's queue, in its metrics).
        self.queued = 0

    async def handle(self, body: bytes, send: Send, headers: Mapping[str, str] | None = None) -> Outcome:
        """Answers the request; returns FAILED when the answer was an error status.

        `headers` are the request's, lower-cased (a dialect may check a signature)."""
        try:
            await self._dispatch(body, send, headers or {})
        except SimError as error:
            await send_error(send, error)
            return Outcome.FAILED
        return Outcome.COMPLETED

    async def _dispatch(self, body: bytes, send: Send, headers: Mapping[str, str]) -> None:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise SimError(400, "request body is not valid JSON") from None
        self.log.append(payload, headers)
        try:
            request = parse_chat_request(
                payload, lambda body: self.dialect.parse(body, headers, self.config), salt_field=self.dialect.cache_salt_field
            )
        except SimError as error:
            if (context_id := self.dialect.context_id_of(payload)) is not None:
                self.handoffs.fail(context_id, f"{error.message} (HTTP {error.status})")
            raise
        kind = request.request_type
        role = self.config.role
        if kind == "context_only" and role == "context":
            await self._context_only(request, send)
        elif kind == "generation_only" and role == "generation":
            await self._generation_only(request, send)
        elif kind == "plain":
            await self._aggregated(request, send)
        else:
            raise SimError(
                400, f"a {role} worker cannot serve request_type {kind}",
                param="disaggregated_params",
            )

    def _prompt_ids(self, request: ChatRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        return tokenize_chat(request.messages, request.tools)

    def _check_length(self, prompt_tokens: int) -> None:
        if prompt_tokens > self.config.max_context_tokens:
            raise context_length_exceeded(self.config.max_context_tokens, prompt_tokens)

    async def _prefill(self, request: ChatRequest, prompt_ids: list[int], *, local: bool = False) -> int:
        """Prefill the prompt's uncached tokens (their time only) and keep its KV in the cache;
        returns how many tokens came from the cache."""
        cache = self.cache
        blocks = cache.hashes(prompt_ids, request.cache_salt)
        if self._prefill_slots is None:
            cached = await self._compute(prompt_ids, blocks, local, request.cache_salt)
        else:
            # Cache hits are looked up when the prompt is scheduled, not when it arrived (as an
            # engine's scheduler does): a prompt queued behind one with the same head reuses it.
            self.queued += 1
            try:
                await self._prefill_slots.acquire()
            finally:
                self.queued -= 1
            try:
                cached = await self._compute(prompt_ids, blocks, local, request.cache_salt)
            finally:
                self._prefill_slots.release()
        if request.directives.context_delay > 0:
            await asyncio.sleep(request.directives.context_delay)
        return cached

    async def _compute(self, prompt_ids: list[int], blocks: list[int], local: bool, salt: str | None) -> int:
        cache = self.cache
        cached = cache.match_blocks(blocks)
        compute = self.config.prefill_seconds(len(prompt_ids) - cached, local=local)
        if compute > 0:
            await asyncio.sleep(compute)
        cache.account(len(prompt_ids), cached)
        cache.store_blocks(blocks, prompt_ids, salt)
        return cached

    async def _context_only(self, request: ChatRequest, send: Send) -> None:
        assert request.disagg is not None
        handoff_id = request.disagg.disagg_request_id
        if handoff_id is None:
            handoff_id = request.disagg.ctx_request_id
        if handoff_id is None:
            raise SimError(
                400, "context_only request carries no disagg_request_id",
                param="disaggregated_params",
            )
        try:
            prompt_ids = self._prompt_ids(request)
            self._check_length(len(prompt_ids))
            await self._prefill(request, prompt_ids)
            if request.directives.context_status is not None:
                raise SimError.simulated(request.directives.context_status)
            first_gen_tokens = [prompt_seed(prompt_ids) % VOCAB_SIZE]
            state = self.handoffs.issue(handoff_id, len(prompt_ids), first_gen_tokens)
            body = self.dialect.context_answer(
                ContextIssue(
                    config=self.config,
                    public_url=self.public_url,
                    handoff_id=handoff_id,
                    encoded_opaque_state=state,
                    first_gen_tokens=first_gen_tokens,
                    prompt_token_ids=prompt_ids,
                    prompt_ids_b64=request.disagg is not None and request.disagg.prompt_ids_b64,
                )
            )
            await send_bytes(send, 200, body)
        except SimError as error:
            # A generation-first taker waiting on this id must fail now, not at its timeout.
            self.handoffs.fail(handoff_id, f"{error.message} (HTTP {error.status})")
            raise
        except asyncio.CancelledError:
            # The client left: no handoff (a held one is dropped, not leaked).
            self.handoffs.fail(handoff_id, "its client aborted the request")
            raise

    async def _generation_only(self, request: ChatRequest, send: Send) -> None:
        assert request.disagg is not None
        prompt_ids = self._prompt_ids(request)
        self._check_length(len(prompt_ids))
        try:
            taken = await self.puller.pull(request.disagg, wait_s=self.config.kv_timeout)
        except SimError as error:
            raise self.dialect.transfer_failed(error) from None
        # The KV that arrived is the context worker's prompt: ids that disagree with it
        # would decode garbage on a real worker, so refuse them.
        kv_tokens = taken.get("prompt_tokens")
        if not isinstance(kv_tokens, int):
            kv_tokens = len(prompt_ids)
        if request.prompt_token_ids is not None and kv_tokens != len(prompt_ids):
            raise SimError(
                400,
                f"prompt_token_ids has {len(prompt_ids)} tokens but the context phase "
                f"prefilled {kv_tokens}",
                param="prompt_token_ids",
            )
        # The transferred KV now lives here too: a later turn sent without a context phase
        # reuses it. What was already held before the transfer is what this worker reports as
        # cached (it need not have been pulled).
        blocks = self.cache.hashes(prompt_ids, request.cache_salt)
        held = self.cache.match_blocks(blocks)
        self.cache.store_blocks(blocks, prompt_ids, request.cache_salt)
        await self._generate(request, prompt_ids, kv_tokens, send, cached_tokens=held)

    async def _aggregated(self, request: ChatRequest, send: Send) -> None:
        prompt_ids = self._prompt_ids(request)
        self._check_length(len(prompt_ids))
        cached = await self._prefill(request, prompt_ids, local=self.config.role == "generation")
        await self._generate(request, prompt_ids, len(prompt_ids), send, cached_tokens=cached)

    async def _generate(
        self, request: ChatRequest, prompt_ids: list[int], prompt_tokens: int, send: Send,
        *, cached_tokens: int = 0,
    ) -> None:
        directives = request.directives
        if directives.gen_status is not None:
            if directives.gen_delay > 0:
                await asyncio.sleep(directives.gen_delay)
            raise SimError.simulated(directives.gen_status)
        # A streamed answer's delay comes after its headers, as a real server's first token does
        # (the response has started; the first chunk is what is slow).
        if directives.gen_delay > 0 and not request.stream:
            await asyncio.sleep(directives.gen_delay)
        limit = request.max_tokens
        if limit is None:
            limit = max(self.config.max_context_tokens - prompt_tokens, 0)
        generation = plan_generation(
            prompt_ids, directives, tools=request.tools, limit=limit, stop=request.stop
        )
        options = EmitOptions(
            model=self.config.model,
            prompt_tokens=prompt_tokens,
            interval=self.config.token_interval,
            include_usage=request.include_usage,
            continuous_usage=request.continuous_usage,
            fail_after=directives.gen_fail_after,
            first_chunk_delay=directives.gen_delay,
            cached_tokens=cached_tokens if self.config.kv_cache_blocks else None,
            prompt_token_ids=prompt_ids if request.return_token_ids else None,
        )
        if request.stream:
            await stream(send, generation, options)
        else:
            await respond(send, generation, options)
