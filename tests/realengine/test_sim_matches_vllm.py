"""The simulator against the real engine: the same requests to a sim worker and to real vLLM,
compared by shape (keys, JSON types, the order of stream chunks, statuses, error wording), never
by generated text.

The sim is what almost every other test runs against, so where it drifts from the engine the
gateway learns shapes no engine sends (it did: an over-length wording vLLM never used, a separate
empty finish chunk, no null `token_ids`/`prompt_token_ids` fields). This module fails when the
sim's aggregated/generation output and vLLM's stop agreeing. It shares the real server with
tests/realengine/test_real_vllm.py and skips (or, with REQUIRE_REAL_VLLM=1, fails) without it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.realvllm.paths import MAX_MODEL_LEN
from tests.support.realvllm.server import RealVllm
from tests.support.simworkers import SimWorker, start_simworker

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
OVER_LENGTH = [{"role": "user", "content": "alpha beta gamma " * (MAX_MODEL_LEN // 3 + 1)}]


@pytest.fixture(scope="module")
def sim(engine: RealVllm) -> Iterator[SimWorker]:
    """A generation sim with the engine's window and model name (fast: shapes, not timing)."""
    worker = start_simworker(
        "generation", model=engine.model, max_context_tokens=engine.max_model_len, tokens_per_second=2000
    )
    yield worker
    worker.stop()


def shape(value: Any) -> Any:
    """The JSON value with every leaf replaced by its type; a list by its distinct item shapes."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        shapes: list[Any] = []
        for item in value:
            if shape(item) not in shapes:
                shapes.append(shape(item))
        return shapes
    if value is None:
        return "null"
    return type(value).__name__


def chat(url: str, model: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": MESSAGES, **body}, timeout=120)


def both(engine: RealVllm, sim: SimWorker, **body: Any) -> tuple[httpx.Response, httpx.Response]:
    return chat(engine.url, engine.model, **body), chat(sim.url, engine.model, **body)


def stream_signature(response: httpx.Response) -> list[Any]:
    """The stream as the shapes of its chunks in order, a run of same-shaped chunks as one."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    signature: list[Any] = []
    for frame in response.text.split("\n\n"):
        if not frame.strip():
            continue
        assert frame.startswith("data: "), frame
        data = frame[len("data: ") :]
        item = data if data == "[DONE]" else shape(json.loads(data))
        if not signature or signature[-1] != item:
            signature.append(item)
    return signature


def test_non_streamed_answer(engine: RealVllm, sim: SimWorker) -> None:
    real, simulated = both(engine, sim, max_tokens=8, temperature=0)
    assert real.status_code == simulated.status_code == 200
    assert real.headers["content-type"].split(";")[0] == simulated.headers["content-type"].split(";")[0]
    assert shape(simulated.json()) == shape(real.json())
    # Both ran into max_tokens (random weights almost never choose the end token in 8).
    assert simulated.json()["choices"][0]["finish_reason"] == real.json()["choices"][0]["finish_reason"] == "length"
    assert simulated.json()["usage"]["completion_tokens"] == real.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    "stream_options",
    [
        None,
        {"include_usage": True},
        {"include_usage": True, "continuous_usage_stats": True},
        {"include_usage": False, "continuous_usage_stats": True},
    ],
    ids=["no-usage", "usage", "continuous-usage", "continuous-without-usage"],
)
def test_streamed_chunks(engine: RealVllm, sim: SimWorker, stream_options: dict[str, Any] | None) -> None:
    body: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "stream": True}
    if stream_options is not None:
        body["stream_options"] = stream_options
    real, simulated = both(engine, sim, **body)
    expected = stream_signature(real)
    assert stream_signature(simulated) == expected
    # role chunk, token chunks, the finishing token's chunk, [the usage chunk], [DONE].
    assert expected[-1] == "[DONE]" and len(expected) == (5 if stream_options and stream_options.get("include_usage") else 4)


def test_usage_chunk_counts(engine: RealVllm, sim: SimWorker) -> None:
    body = {"max_tokens": 5, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    for response in both(engine, sim, **body):
        chunks = [json.loads(f[6:]) for f in response.text.split("\n\n") if f.startswith("data: {")]
        usage_chunk = chunks[-1]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
        finishing = chunks[-2]["choices"][0]
        assert finishing["finish_reason"] == "length" and "content" in finishing["delta"]


@pytest.mark.parametrize("stream", [False, True])
def test_over_length_prompt(engine: RealVllm, sim: SimWorker, stream: bool) -> None:
    body = {"messages": OVER_LENGTH, "max_tokens": 16, "stream": stream}
    real = httpx.post(engine.url + "/v1/chat/completions", json={"model": engine.model, **body}, timeout=120)
    simulated = httpx.post(sim.url + "/v1/chat/completions", json={"model": engine.model, **body}, timeout=120)
    # A plain JSON 400 even when streamed, with the same words (same window, "at least" max + 1).
    assert real.status_code == simulated.status_code == 400
    assert real.headers["content-type"].startswith("application/json")
    assert simulated.headers["content-type"].startswith("application/json")
    assert simulated.json() == real.json()


def test_malformed_request(engine: RealVllm, sim: SimWorker) -> None:
    real, simulated = both(engine, sim, messages="notalist")
    assert real.status_code == simulated.status_code == 400
    assert shape(simulated.json()) == shape(real.json())
    assert simulated.json()["error"]["code"] == real.json()["error"]["code"] == 400


def test_its_load_is_read_by_the_gateways_vllm_reader(engine: RealVllm) -> None:  # noqa: F811
    """The gateway's vLLM reader (workers.protocols.vllm, used by workers.cluster.engine_load) finds
    the real engine's queue, running requests and KV use in its /metrics; the sim's vLLM dialect
    publishes the same names (tests/unit/workers/test_sim_engine_metrics.py)."""
    from workers.protocols import PROTOCOLS

    reader = PROTOCOLS["vllm"]
    assert reader.metrics_path is not None
    load = reader.read_load(httpx.get(engine.url + reader.metrics_path, timeout=10).text, engine.model)
    assert load is not None and load.waiting >= 0 and load.running >= 0
    assert load.kv_usage is not None and 0.0 <= load.kv_usage <= 1.0
