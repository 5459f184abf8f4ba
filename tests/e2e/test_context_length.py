"""Every engine's over-length wording becomes ContextLengthExceeded, which the front door turns
into Anthropic's wording: "prompt is too long: N tokens > M maximum" (what Claude Code compacts
on), or, when the prompt fits and only the output requested on top of it does not, "input length
and `max_tokens` exceed context limit: P + T > M, …" (what Claude Code retries with a smaller
max_tokens on). A max_tokens larger than the whole window is a plain bad request about max_tokens.

Each wording is the engine's own text, quoted from its source or its real server's answer, and
read with its engine's protocol's `error_wordings`; each goes through the real worker client (a
real HTTP answer, non-streamed and streamed, before the stream and as an SSE error frame after
it), and through a real gateway to an Anthropic client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from messages_api.errors import client_error
from tests.support.cluster import Cluster, audit_row, register_cluster, wait_registered
from tests.support.gateway import Gateway
from tests.support.rawclient import RawStream
from tests.support.scripted import Request, ScriptedServer, answering, response
from tests.support.simworkers import SimWorker
from workers.exceptions import ContextLengthExceeded, OutputLimitExceeded, WorkerError
from workers.protocols import PROTOCOLS, error_wordings
from workers.wire.client import open_stream, post_completion
from workers.wire.error_reading import worker_error

EVERY = error_wordings()  # as the pipeline reads a worker's error answer


def too_long(prompt: int, maximum: int) -> str:
    return f"prompt is too long: {prompt} tokens > {maximum} maximum"


def prompt_and_output(prompt: int, output: int, maximum: int) -> str:
    return (
        f"input length and `max_tokens` exceed context limit: {prompt} + {output} > {maximum}, "
        "decrease input length or `max_tokens` and try again"
    )


# (engine's error body, what the client is told)
WORDINGS: dict[str, tuple[dict[str, Any], str]] = {
    # TensorRT-LLM's OpenAI server since PR #19457 (https://github.com/NVIDIA/TensorRT-LLM/pull/19457).
    "trtllm": (
        {
            "error": {
                "message": "This model's maximum context length is 69632 tokens. However, your messages resulted in "
                "69666 tokens. Please reduce the length of the messages.",
                "type": "BadRequestError",
                "code": "context_length_exceeded",
            }
        },
        too_long(69666, 69632),
    ),
    # TensorRT-LLM before it, TensorRT backend: tensorrt_llm/llmapi/llm.py `_check_arguments`
    # (the prompt length prints as a float). The prompt alone is over the window ...
    "trtllm_max_seq_len": (
        {
            "object": "error",
            "message": "The sum of prompt length (5000.0) and query length (0) max_tokens (16) should not exceed "
            "max_seq_len (4096)",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        too_long(5000, 4096),
    ),
    # ... or it fits and the output requested on top of it does not.
    "trtllm_max_seq_len_output": (
        {
            "object": "error",
            "message": "The sum of prompt length (4000.0) and query length (0) max_tokens (2048) should not exceed "
            "max_seq_len (4096)",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        prompt_and_output(4000, 2048, 4096),
    ),
    # ... PyTorch backend (the same method; TensorRT-LLM's test_max_num_token_check).
    "trtllm_max_num_tokens": (
        {
            "object": "error",
            "message": "The sum of prompt length (50857.0), query length (0) should not exceed max_num_tokens (32768)",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        too_long(50857, 32768),
    ),
    # ... executor/base_worker.py `_deduce_max_tokens`.
    "trtllm_default_max_tokens": (
        {
            "object": "error",
            "message": "`default_max_tokens` (-40205) should be greater than 0, `default_max_tokens` (-40205) = "
            "max_seq_len (40961) - `splited_prompt_len` (81166) - `query_token_len` (0)",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        too_long(81166, 40961),
    ),
    # vLLM 0.32, a real server (tests/realengine/test_sim_matches_vllm.py holds the sim to it).
    "vllm": (
        {
            "error": {
                "message": "This model's maximum context length is 4096 tokens. However, your prompt contains at least "
                "4097 input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                "of the input prompt. (parameter=input_tokens, value=4097)",
                "type": "BadRequestError",
                "param": "input_tokens",
                "code": 400,
            }
        },
        too_long(4097, 4096),
    ),
    # vLLM's max_tokens check: the prompt fits, the output requested on top of it does not.
    "vllm_output": (
        {
            "error": {
                "message": "This model's maximum context length is 8192 tokens. However, you requested 900 output "
                "tokens and your prompt contains at least 7293 input tokens, for a total of at least 8193 tokens. "
                "Please reduce the length of the input prompt or the number of requested output tokens. "
                "(parameter=input_tokens, value=7293)",
                "type": "BadRequestError",
                "param": "input_tokens",
                "code": 400,
            }
        },
        prompt_and_output(7293, 900, 8192),
    ),
    # OpenAI (and older vLLM).
    "openai": (
        {
            "error": {
                "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
                "(4500 in the messages, 500 in the completion). Please reduce the length of the messages or completion.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
        too_long(4500, 4096),
    ),
    "openai_output": (
        {
            "error": {
                "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
                "(4000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
        prompt_and_output(4000, 1000, 4096),
    ),
    # SGLang: python/sglang/srt/managers/tokenizer_manager.py `_validate_one_request`.
    "sglang": (
        {
            "object": "error",
            "message": "The input (4100 tokens) is longer than the model's context length (4096 tokens).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        too_long(4100, 4096),
    ),
    "sglang_output": (
        {
            "object": "error",
            "message": "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested "
            "a total of 4200 tokens: 200 tokens from the input messages and 4000 tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit within the limit.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        prompt_and_output(200, 4000, 4096),
    ),
    # A bare code, no numbers: still the wording Claude Code compacts on.
    "bare_code": (
        {"error": {"message": "Request too large for this model.", "type": "invalid_request_error", "code": "context_length_exceeded"}},
        "prompt is too long: it does not fit the model's context window",
    ),
    # A wording not listed that names the window.
    "unknown_wording": (
        {"error": {"message": "This model's maximum context length is 2048 tokens; the request is longer.", "code": 400}},
        "prompt is too long: it does not fit the model's context window of 2048 tokens",
    ),
}
# vLLM 0.32, a real server (tests/realengine/test_real_vllm.py, max_tokens beyond the window): not an
# over-length prompt (shortening it cannot help): a bad request about max_tokens.
MAX_TOKENS_TOO_BIG = {
    "error": {
        "message": "max_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens. "
        "(parameter=max_tokens, value=5000)",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
}
MAX_TOKENS_MESSAGE = "max_tokens: 5000 > 4096, which is the maximum allowed number of output tokens for this model"


@pytest.mark.parametrize("name", list(WORDINGS))
def test_every_over_length_wording(name: str) -> None:
    body, expected = WORDINGS[name]
    error = worker_error(400, orjson.dumps(body), "generation", wordings=EVERY)
    assert isinstance(error, ContextLengthExceeded)
    told = client_error(error)
    assert (told.status, told.error_type, told.message) == (400, "invalid_request_error", expected)


@pytest.mark.parametrize("name", list(WORDINGS))
def test_each_wording_is_its_engines(name: str) -> None:
    # Named after its engine (the protocol module that holds it); the rest need no engine's.
    engine = PROTOCOLS.get(name.split("_")[0])
    body, expected = WORDINGS[name]
    error = worker_error(400, orjson.dumps(body), "generation", wordings=engine.error_wordings if engine else ())
    assert client_error(error).message == expected


def test_max_tokens_larger_than_the_window_is_about_max_tokens() -> None:
    vllms = worker_error(400, orjson.dumps(MAX_TOKENS_TOO_BIG), "generation", wordings=PROTOCOLS["vllm"].error_wordings)
    assert isinstance(vllms, OutputLimitExceeded)  # vLLM's sentence
    error = worker_error(400, orjson.dumps(MAX_TOKENS_TOO_BIG), "generation", wordings=EVERY)
    assert isinstance(error, OutputLimitExceeded)
    told = client_error(error)
    assert (told.status, told.error_type, told.message) == (400, "invalid_request_error", MAX_TOKENS_MESSAGE)
    assert "prompt is too long" not in told.message


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (400, "max_tokens must be at least 1"),
        # A worker fault that happens to name the window: not the client's to fix.
        (500, "This model's maximum context length is 4096 tokens. However, your messages resulted in 5000 tokens."),
    ],
)
def test_other_errors_stay_plain(status: int, message: str) -> None:
    error = worker_error(status, orjson.dumps({"error": {"message": message}}), "generation", wordings=EVERY)
    assert type(error) is WorkerError and error.status == status


def test_absurd_counts_from_a_worker_are_no_crash() -> None:
    huge = "9" * 5000  # int() refuses strings over 4,300 digits
    message = f"This model's maximum context length is {huge} tokens. However, your messages resulted in {huge} tokens."
    error = worker_error(
        400, orjson.dumps({"error": {"message": message, "code": "context_length_exceeded"}}), "generation", wordings=EVERY
    )
    assert isinstance(error, ContextLengthExceeded) and error.prompt_tokens is None and error.max_context_tokens is None
    assert client_error(error).message == "prompt is too long: it does not fit the model's context window"


# --- through the real worker client --------------------------------------------------------------


class ErrorWorker:
    """A worker that answers every chat request with one canned answer: `status` with a JSON body
    (`frame=False`), or a 200 event stream whose one frame is the error (`frame=True`: an engine
    that reports a request error inside its stream, as SGLang and vLLM can). A real HTTP server
    (tests/support/scripted.py's, in a thread of its own)."""

    def __init__(self) -> None:
        self.status = 400
        self.body: dict[str, Any] = {}
        self.frame = False
        self.server = ScriptedServer(answering(self._answer)).start_thread()
        self.url = self.server.url

    def _answer(self, request: Request) -> bytes:
        closing = {"connection": "close"}
        if request.method == "GET":
            return response(200, b"{}", content_type="application/json", headers=closing)
        if self.frame:
            return response(200, b"data: " + orjson.dumps(self.body) + b"\n\n", content_type="text/event-stream", headers=closing)
        return response(self.status, orjson.dumps(self.body), content_type="application/json", headers=closing)

    def reset(self) -> None:
        self.answer({})

    def answer(self, body: dict[str, Any], *, status: int = 400, frame: bool = False) -> None:
        # In a stream, vLLM and SGLang wrap their flat error object: {"error": {..., "code": 400}}.
        self.body = {"error": body} if frame and "error" not in body else body
        self.status, self.frame = status, frame

    def stop(self) -> None:
        self.server.stop_thread()


@pytest.fixture(scope="module")
def error_worker() -> Iterator[ErrorWorker]:
    worker = ErrorWorker()
    yield worker
    worker.stop()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
# Where an engine puts a request error: the answer to a non-streamed call, the answer to a
# streamed one (vLLM: plain JSON before any event), or an error frame inside the stream (SGLang).
HOW = ["answer", "streamed_answer", "stream_frame"]


async def worker_call_error(worker: ErrorWorker, body: dict[str, Any], how: str) -> WorkerError:
    worker.answer(body, frame=how == "stream_frame")
    url = worker.url + "/v1/chat/completions"
    with pytest.raises(WorkerError) as caught:
        if how == "answer":
            await post_completion(url, CHAT, stage="generation", wordings=EVERY)
        else:
            stream = await open_stream(url, {**CHAT, "stream": True}, stage="generation", wordings=EVERY)
            try:
                await stream.pump(lambda _: None)
            finally:
                await stream.aclose()
    return caught.value


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", list(WORDINGS))
async def test_every_wording_from_a_worker_call(error_worker: ErrorWorker, name: str, how: str) -> None:
    body, expected = WORDINGS[name]
    error = await worker_call_error(error_worker, body, how)
    assert isinstance(error, ContextLengthExceeded), error
    assert client_error(error).message == expected


@pytest.mark.parametrize("how", HOW)
async def test_max_tokens_too_big_from_a_worker_call(error_worker: ErrorWorker, how: str) -> None:
    error = await worker_call_error(error_worker, MAX_TOKENS_TOO_BIG, how)
    assert isinstance(error, OutputLimitExceeded), error
    assert client_error(error).message == MAX_TOKENS_MESSAGE


# --- through a real gateway ------------------------------------------------------------------------

MODEL = "overlength-model"


@pytest.fixture
def error_cluster(transactional_db: Any, patient_gateway: Gateway, context_worker: SimWorker, error_worker: ErrorWorker) -> Cluster:
    """A pool whose prompts all skip the context phase, so each request goes straight to the
    error worker as its generation endpoint."""
    cluster = register_cluster(context_worker, error_worker, model=MODEL, max_local_prefill_tokens=100_000)
    wait_registered(patient_gateway, cluster)
    return cluster


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["trtllm", "vllm_output", "sglang", "bare_code"])
def test_a_client_is_told_the_same_streamed_or_not(patient_gateway: Gateway, error_cluster: Cluster, error_worker: ErrorWorker, name: str) -> None:
    body, expected = WORDINGS[name]
    payload = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    # Before anything was streamed: the HTTP error, streamed or not.
    error_worker.answer(body)
    for stream in (False, True):
        response = httpx.post(patient_gateway.url + "/v1/messages", json={**payload, "stream": stream}, headers=error_cluster.headers(), timeout=10)
        assert response.status_code == 400, response.text
        assert response.json()["error"] == {"type": "invalid_request_error", "message": expected}
        row = audit_row(response.headers["request-id"])
        assert row.status == "failed" and row.http_status == 400
    # The engine reports it inside its stream, after the gateway's stream began: the error event.
    error_worker.answer(body, frame=True)
    s = RawStream.post_json(patient_gateway.url + "/v1/messages", {**payload, "stream": True}, error_cluster.headers())
    frames = s.read_all(timeout=10)
    assert s.status == 200
    events = [f for f in frames if f.event != "ping"]
    assert events[-1].event == "error" and "message_stop" not in [f.event for f in events]
    assert events[-1].data["error"] == {"type": "invalid_request_error", "message": expected}
    assert json.dumps(events[-1].data).find("127.0.0.1") == -1
