"""A plain OpenAI-compatible server: no disaggregation, every request whole to one endpoint.

For pools of servers that cannot split a request between prefill and decode workers (vLLM or
SGLang without a KV connector, llama.cpp's `llama-server`, Ollama): the pool's schedule is
`aggregated` and it has generation endpoints only.

The request is streamed with `stream_options: {"include_usage": true}`, which all of those
accept, so the stream ends with a usage chunk (the answer's token counts). vLLM's (and SGLang's)
`continuous_usage_stats` is not sent: a plain server of another make has no such option, and
usage on the last chunk is all the answer's totals need (`message_start` then reports zero input
tokens, the final `message_delta` the real count).

No cache salt is sent: such servers have no field for one, so the pool's keys share the server's
prefix cache whatever the pool's `cache_scope`; a pool that keeps keys apart reports no cache hit
to any of them instead (`WorkerProtocol.cache_salt_field`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from workers.protocols.base import AGGREGATED, Call, WorkerProtocol, streamed_request
from workers.wire.error_reading import Wordings, wording

STREAM_OPTIONS = {"include_usage": True}

# OpenAI's sentence for a request that does not fit (`WorkerProtocol.error_wordings`), which
# servers copying its API answer with too (older vLLM). A plain pool's servers are read with every
# engine's wordings (`workers.protocols.error_wordings`), whichever engine they are.
WORDINGS: Wordings = (
    # "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens
    # (4000 in the messages, 1000 in the completion). ..."
    wording(
        r"maximum context length is (?P<maximum>\d{1,12}) tokens\. However, you requested \d+ tokens "
        r"\((?P<prompt>\d{1,12}) in the messages, (?P<output>\d{1,12}) in the completion\)"
    ),
)


class OpenAIProtocol(WorkerProtocol):
    name: ClassVar[str] = "openai"
    label: ClassVar[str] = "Plain OpenAI-compatible (no disaggregation)"
    schedules: ClassVar[frozenset[str]] = frozenset({AGGREGATED})
    error_wordings: ClassVar[Wordings] = WORDINGS

    def aggregated_request(self, chat: dict[str, Any], call: Call) -> dict[str, Any]:
        return streamed_request(chat, STREAM_OPTIONS)


PROTOCOL = OpenAIProtocol()
