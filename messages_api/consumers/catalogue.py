"""The catalogue routes: `count_tokens` and `/v1/models`."""

from __future__ import annotations

from urllib.parse import parse_qs

from messages_api import intake
from messages_api.consumers.base import ApiConsumer
from messages_api.errors import NotFound
from messages_api.model_list import model_info, model_page
from messages_api.selection import pool_for_model
from workers import count_prompt_tokens, get_registry


class CountTokensConsumer(ApiConsumer):
    """`POST /v1/messages/count_tokens` → `{"input_tokens": N}`."""

    async def handle_request(self, body: bytes) -> None:
        principal = await self.authenticate()
        request, chat = await intake.count_tokens_request(body)
        pool = await pool_for_model(request["model"], principal, chat)
        count = await count_prompt_tokens(pool, chat)
        await self.send_json(200, {"input_tokens": count})


class ModelsConsumer(ApiConsumer):
    """`GET /v1/models` and `GET /v1/models/{id}`: the exact public names (the catalogue's routes
    and the pools' own models) the key may use, in Anthropic's shape."""

    allowed_methods = ("GET",)

    async def handle_request(self, body: bytes) -> None:
        principal = await self.authenticate()
        snapshot = await get_registry().snapshot()
        models = [model_info(*public) for public in snapshot.public_models() if principal.may_use(public[0])]
        # URLRouter sets `url_route` on HTTP scopes too; the stubs' HTTPScope does not declare it.
        model_id = self.scope["url_route"]["kwargs"].get("model_id")  # type: ignore[typeddict-item]
        if model_id is not None:
            found = next((m for m in models if m["id"] == model_id), None)
            if found is None:
                raise NotFound(f"model: {model_id}")
            await self.send_json(200, found)
            return
        await self.send_json(200, model_page(models, parse_qs(self.scope.get("query_string", b"").decode())))
