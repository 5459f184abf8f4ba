"""A plain OpenAI-compatible server: no disaggregation, every request whole to one endpoint.

For pools of servers that cannot split a request between prefill and decode workers (vLLM or
SGLang without a KV connector, llama.cpp's `llama-server`, Ollama): the pool's schedule is
`aggregated` and it has generation endpoints only.

The request is streamed with `stream_options: {"include_usage": true}`, which all of those
accept, so the stream ends with a usage chunk (the answer's token counts). vLLM's (and SGLang's)
`continuous_usage_stats` is not sent: a plain server of another make has no such option, and
usage on the last chunk is all the answer's totals need (`message_start` then reports zero input
tokens, the final `message_delta` the real count).
"""

from __future__ import annotations

from typing import Any, ClassVar

from workers.protocols.base import AGGREGATED, Call, WorkerProtocol, streamed_request

STREAM_OPTIONS = {"include_usage": True}


class OpenAIProtocol(WorkerProtocol):
    name: ClassVar[str] = "openai"
    label: ClassVar[str] = "Plain OpenAI-compatible (no disaggregation)"
    schedules: ClassVar[frozenset[str]] = frozenset({AGGREGATED})

    def aggregated_request(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        return streamed_request(chat, STREAM_OPTIONS)


PROTOCOL = OpenAIProtocol()
