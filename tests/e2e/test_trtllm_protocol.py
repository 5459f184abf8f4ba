"""TensorRT-LLM's disaggregated protocol as NVIDIA/TensorRT-LLM main speaks it.

The builders and the signature against upstream's canonical form (`disagg_auth.py`, the expected
HMACs computed here independently); the simulator enforcing what a real worker enforces; and end
to end through a daphne gateway and signed sims: both schedules, a pool with the wrong key or none,
a context server whose /server_info is down. Then the write-only key: `register_worker` and the
admin form.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.cluster import SIGNING_KEY, Cluster, audit_row, register_cluster, reservations_closed, wait_registered, wait_until
from tests.support.gateway import Gateway
from tests.support.ports import refused_url, unused_port
from tests.support.simworkers import SimWorker
from workers.exceptions import MalformedAnswer, WorkerError, WorkerUnreachable
from workers.protocols import trtllm
from workers.protocols.base import USAGE_ON_EVERY_CHUNK, Call
from workers.sim.schema import encode_token_ids_b64

UPSTREAM_ENDPOINT = "tcp://10.0.0.1:5000"


def hmac_hex(key: str, message: str) -> str:
    return "sha256=" + hmac.new(key.encode(), message.encode(), hashlib.sha256).hexdigest()


def transceiver(worker: SimWorker) -> str:
    return "tcp://" + worker.url.removeprefix("http://")


def context_answer(finish_reason: str = "length", **changes: Any) -> dict[str, Any]:
    params = {"request_type": "context_only", "ctx_request_id": 7, "disagg_request_id": 7, "encoded_opaque_state": "b3BhcXVl",
              "first_gen_tokens": [9], "ctx_info_endpoint": UPSTREAM_ENDPOINT}
    answer: dict[str, Any] = {
        "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": finish_reason,
                     "disaggregated_params": params}],
        "prompt_token_ids": [1, 2, 3],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    answer.update(changes)
    return answer


CHAT = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}


# --- the signature ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params,canonical",
    [
        ({"ctx_info_endpoint": UPSTREAM_ENDPOINT}, '{"ctx_info_endpoint":"tcp://10.0.0.1:5000","encoded_opaque_state":null}'),
        ({"ctx_info_endpoint": [UPSTREAM_ENDPOINT, "tcp://x:1"]}, '{"ctx_info_endpoint":"tcp://10.0.0.1:5000","encoded_opaque_state":null}'),
        ({"encoded_opaque_state": "b3BhcXVl", "request_type": "generation_only"}, '{"ctx_info_endpoint":null,"encoded_opaque_state":"b3BhcXVl"}'),
        # json.dumps escapes non-ASCII: the worker recomputes it that way.
        ({"ctx_info_endpoint": "tcp://é", "encoded_opaque_state": "s"}, '{"ctx_info_endpoint":"tcp://\\u00e9","encoded_opaque_state":"s"}'),
    ],
)
def test_signature_is_upstreams_hmac_over_the_canonical_fields(params: dict[str, Any], canonical: str) -> None:
    assert trtllm.canonical_auth_payload(params) == canonical.encode()
    assert trtllm.sign("secret", params) == hmac_hex("secret", canonical)


def test_only_requests_with_protected_fields_are_signed_and_only_with_a_key() -> None:
    signed = Call("r1", signing_key="secret")
    first = trtllm.generation_request_first(CHAT, 5, {"ctx_info_endpoint": UPSTREAM_ENDPOINT}, "generation_first")
    expected = hmac_hex("secret", '{"ctx_info_endpoint":"tcp://10.0.0.1:5000","encoded_opaque_state":null}')
    assert trtllm.PROTOCOL.headers(first, signed) == {"x-trtllm-disagg-auth": expected}
    # Upstream's proxy without a key sends it unsigned; a context request has nothing to sign.
    assert trtllm.PROTOCOL.headers(first, Call("r2")) == {}
    assert trtllm.PROTOCOL.headers(trtllm.context_request(CHAT, 5, "context_first"), signed) == {}
    assert trtllm.PROTOCOL.headers(trtllm.streamed(CHAT), signed) == {}
    assert "secret" not in repr(signed)


# --- the builders ----------------------------------------------------------------------------------


def test_context_request_fields() -> None:
    body = trtllm.context_request({**CHAT, "stream": True, "stream_options": {"include_usage": True}}, 11, "context_first", "conv-1")
    assert body["stream"] is False and "stream_options" not in body
    assert body["disaggregated_params"] == {
        "request_type": "context_only", "disagg_request_id": 11, "schedule_style": "context_first", "conversation_id": "conv-1"}
    # No conversation known: none sent; return_prompt_token_ids_b64 is upstream's opt-in, not asked.
    assert trtllm.context_request(CHAT, 11, "generation_first")["disaggregated_params"] == {
        "request_type": "context_only", "disagg_request_id": 11, "schedule_style": "generation_first"}


def test_generation_after_context_carries_the_handoff_usage_and_prompt() -> None:
    handoff = trtllm.read_context_response(context_answer())
    assert handoff.generation_pending and handoff.prompt_tokens == 3
    body = trtllm.generation_request_after_context(CHAT, handoff, "context_first", "conv-1")
    assert body["stream"] is True and body["stream_options"] == USAGE_ON_EVERY_CHUNK
    assert body["disaggregated_params"] == {
        "request_type": "generation_only", "ctx_request_id": 7, "disagg_request_id": 7, "encoded_opaque_state": "b3BhcXVl",
        "first_gen_tokens": [9], "ctx_info_endpoint": UPSTREAM_ENDPOINT, "schedule_style": "context_first",
        "conversation_id": "conv-1", "ctx_usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    assert body["prompt_token_ids"] == [1, 2, 3] and "prompt_token_ids_b64" not in body
    # The base64 form is relayed verbatim (never decoded) and wins over the list.
    b64 = trtllm.read_context_response(context_answer(prompt_token_ids_b64="AQAAAAIAAAA="))
    body = trtllm.generation_request_after_context(CHAT, b64)
    assert body["prompt_token_ids_b64"] == "AQAAAAIAAAA=" and "prompt_token_ids" not in body
    assert "conversation_id" not in body["disaggregated_params"]


@pytest.mark.parametrize("missing", ["ctx_request_id", "disagg_request_id"])
@pytest.mark.parametrize("finish_reason", ["length", "not_finished"])
def test_a_pending_handoff_needs_both_ids(missing: str, finish_reason: str) -> None:
    answer = context_answer(finish_reason)
    del answer["choices"][0]["disaggregated_params"][missing]
    with pytest.raises(MalformedAnswer) as raised:
        trtllm.read_context_response(answer)
    assert raised.value.status == 502 and raised.value.stage == "context" and missing in raised.value.message


@pytest.mark.parametrize("finish_reason", ["stop", "tool_calls", None])
def test_an_answer_finished_in_the_context_phase_is_the_answer(finish_reason: str | None) -> None:
    answer = context_answer(finish_reason)
    del answer["choices"][0]["disaggregated_params"]["disagg_request_id"]  # not needed: nothing pending
    result = trtllm.read_context_response(answer)
    assert not result.generation_pending
    complete = result.complete_answer
    assert complete is not None and "disaggregated_params" not in complete["choices"][0]
    assert complete["choices"][0]["message"]["content"] == "hi"
    assert "disaggregated_params" in answer["choices"][0]  # the worker's answer is not modified


@pytest.mark.parametrize(
    "change",
    [
        lambda a: a["choices"][0].pop("disaggregated_params"),
        lambda a: a.update(prompt_token_ids_b64=[1]),
        lambda a: a.update(prompt_token_ids=["1"]),
        # Every id is checked, not the first: a bool (an int to isinstance) or a float among ints.
        lambda a: a.update(prompt_token_ids=[1, 2, True]),
        lambda a: a.update(prompt_token_ids=[1, 2.0]),
        lambda a: a.update(prompt_token_ids={"1": 1}),
        lambda a: a["choices"][0]["disaggregated_params"].update(ctx_request_id="7"),
    ],
)
def test_a_malformed_context_answer_is_refused(change: Callable[[dict[str, Any]], Any]) -> None:
    answer = context_answer()
    change(answer)
    with pytest.raises(WorkerError) as raised:
        trtllm.read_context_response(answer)
    assert raised.value.status == 502


_JSON_ITEMS = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


@given(st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1)) | st.lists(_JSON_ITEMS, max_size=6))
def test_the_token_id_check_means_every_item_an_int_and_none_a_bool(ids: list[Any]) -> None:
    """The fast check agrees with the plain one on anything orjson.loads can make (ints up to 64
    bits, floats, bools, null, strings, nested lists and objects)."""
    assert trtllm._all_ints(ids) == all(isinstance(i, int) and not isinstance(i, bool) for i in ids)


def test_the_token_id_check_refuses_an_int_no_worker_request_could_carry() -> None:
    assert not trtllm._all_ints([1, 2**64])


def test_an_empty_or_long_list_of_token_ids_is_relayed() -> None:
    for ids in ([], list(range(20_000))):
        result = trtllm.read_context_response(context_answer(prompt_token_ids=ids))
        assert result.prompt_token_ids == ids


def test_generation_first_takes_only_the_context_side_fields_of_server_info() -> None:
    reported = {"server_info": {"disaggregated_params": {
        "ctx_info_endpoint": [UPSTREAM_ENDPOINT], "ctx_dp_rank": 2,
        # A worker may not rename the request nor change its type.
        "request_type": "context_only", "disagg_request_id": 1, "ctx_request_id": 1}}}
    peer = trtllm.peer_params(reported)
    assert peer == {"ctx_info_endpoint": UPSTREAM_ENDPOINT, "ctx_dp_rank": 2}
    body = trtllm.generation_request_first(CHAT, 99, peer, "generation_first", "conv-2")
    assert body["disaggregated_params"] == {
        "request_type": "generation_only", "ctx_request_id": 99, "disagg_request_id": 99, "schedule_style": "generation_first",
        "conversation_id": "conv-2", "ctx_info_endpoint": UPSTREAM_ENDPOINT, "ctx_dp_rank": 2}


@pytest.mark.parametrize(
    "reported",
    [[], {}, {"server_info": {}}, {"server_info": {"disaggregated_params": {"ctx_info_endpoint": []}}},
     {"server_info": {"disaggregated_params": {"ctx_info_endpoint": [5]}}},
     {"server_info": {"disaggregated_params": {"ctx_info_endpoint": "x" * 600}}}],
)
def test_server_info_without_a_usable_endpoint_is_refused(reported: Any) -> None:
    with pytest.raises(MalformedAnswer) as raised:
        trtllm.peer_params(reported)
    assert raised.value.stage == "context" and raised.value.status == 502


def test_an_auth_rejection_is_the_gateways_failure_and_says_why() -> None:
    rejected = WorkerError(400, "Invalid internal disaggregated request authentication", stage="generation")
    for call, why in ((Call("r", signing_key="k"), "does not share"), (Call("r"), "has no handoff signing key")):
        explained = trtllm.PROTOCOL.explain_error(rejected, call)
        assert (explained.status, explained.stage, explained.code) == (500, "generation", "handoff_auth_rejected")
        assert why in explained.detail and "Invalid internal disaggregated" in explained.detail
        assert "k" not in explained.message.split()
    other = WorkerError(400, "messages must be a list", stage="generation")
    assert trtllm.PROTOCOL.explain_error(other, Call("r")) is other


# --- /server_info, cached --------------------------------------------------------------------------


async def test_server_info_is_read_once_per_ttl_and_a_failure_is_not_kept(sim_pair: Callable[..., tuple[SimWorker, SimWorker]]) -> None:
    context, _ = sim_pair("trtllm")
    cache = trtllm.ServerInfoCache(ttl_s=60.0, size=2)
    params = await cache.read(context.url)
    assert params == {"ctx_info_endpoint": transceiver(context), "ctx_dp_rank": 0}
    assert cache.get(context.url) == params
    dead = refused_url()
    with pytest.raises(WorkerUnreachable) as raised:
        await cache.read(dead)
    assert raised.value.stage == "context"
    assert cache.get(dead) is None
    # Bounded: the oldest goes first.
    cache.put("http://a", {"ctx_info_endpoint": "tcp://a"})
    cache.put("http://b", {"ctx_info_endpoint": "tcp://b"})
    assert cache.get(context.url) is None and cache.get("http://b") is not None
    short = trtllm.ServerInfoCache(ttl_s=0.05)
    short.put("http://a", {"ctx_info_endpoint": "tcp://a"})
    wait_until(lambda: short.get("http://a") is None, timeout=2.0)


# --- the simulator enforces what the real worker does ----------------------------------------------


def sim_chat(worker: SimWorker, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(worker.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=30, trust_env=False)


def signed(params: dict[str, Any], key: str = SIGNING_KEY) -> dict[str, str]:
    endpoint = params.get("ctx_info_endpoint")
    state = params.get("encoded_opaque_state")
    e = "null" if endpoint is None else f'"{endpoint}"'
    s = "null" if state is None else f'"{state}"'
    return {"x-trtllm-disagg-auth": hmac_hex(key, f'{{"ctx_info_endpoint":{e},"encoded_opaque_state":{s}}}')}


def test_sim_server_info_reports_a_transceiver_address(sim_pair: Callable[..., tuple[SimWorker, SimWorker]]) -> None:
    context, _ = sim_pair("trtllm")
    info = httpx.get(context.url + "/server_info", timeout=5, trust_env=False).json()
    assert info == {"server_info": {"disaggregated_params": {"ctx_dp_rank": 0, "ctx_info_endpoint": [transceiver(context)]}}}


def test_sim_takes_only_signed_handoffs(sim_pair: Callable[..., tuple[SimWorker, SimWorker]]) -> None:
    # The handoff must stay held through three refused requests and the accepted one: a hold
    # generous against a loaded machine's pauses (2 s once expired first, on a fresh clone).
    context, generation = sim_pair("trtllm", kv_timeout=120)
    request_id = int(time.monotonic_ns() % 10**9)
    answer = sim_chat(context, {**CHAT, "disaggregated_params": {"request_type": "context_only", "disagg_request_id": request_id}})
    assert answer.status_code == 200, answer.text
    handoff = answer.json()["choices"][0]["disaggregated_params"]
    assert handoff["ctx_info_endpoint"] == transceiver(context) and handoff["disagg_request_id"] == request_id
    params = {**handoff, "request_type": "generation_only"}
    body = {**CHAT, "prompt_token_ids": answer.json()["prompt_token_ids"], "disaggregated_params": params}
    tampered = {**params, "encoded_opaque_state": "c2lta3YxOmZvcmdlZA=="}
    for headers, sent in (({}, params), (signed(params, "wrong"), params), (signed(params), tampered)):
        refused = sim_chat(generation, {**body, "disaggregated_params": sent}, headers)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["message"] == "Invalid internal disaggregated request authentication"
    assert context.stats()["kv_held"] == 1  # nothing refused took the handoff
    taken = sim_chat(generation, body, signed(params))
    assert taken.status_code == 200, taken.text
    assert context.stats()["kv_held"] == 0


def test_sim_refuses_an_http_endpoint_and_a_context_request_without_its_id(sim_pair: Callable[..., tuple[SimWorker, SimWorker]]) -> None:
    context, generation = sim_pair("trtllm")
    params = {"request_type": "generation_only", "ctx_request_id": 1, "disagg_request_id": 1, "ctx_info_endpoint": context.url}
    refused = sim_chat(generation, {**CHAT, "disaggregated_params": params}, signed(params))
    assert refused.status_code == 400 and "not an HTTP URL" in refused.json()["error"]["message"]
    no_id = sim_chat(context, {**CHAT, "disaggregated_params": {"request_type": "context_only", "ctx_request_id": 3}})
    assert no_id.status_code == 400 and "disagg_request_id" in no_id.json()["error"]["message"]


# --- end to end: daphne gateway, signed sims -------------------------------------------------------


def post(gateway: Gateway, cluster: Cluster, text: str, **headers: str) -> httpx.Response:
    payload = {"model": cluster.model, "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    return httpx.post(gateway.url + "/v1/messages", json=payload, headers=cluster.headers(**headers), timeout=30)


def test_both_schedules_succeed_signed_with_upstreams_fields(gateway: Gateway, cluster: Cluster, schedule_style: str) -> None:
    response = post(gateway, cluster, "Signed please [sim tokens=4]", **{"x-claude-code-session-id": "conv-77"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] == 4
    context_body = cluster.context.requests()[-1]
    generation_body = cluster.generation.requests()[-1]
    sent = context_body["disaggregated_params"]
    assert sent == {"request_type": "context_only", "disagg_request_id": sent["disagg_request_id"],
                    "schedule_style": schedule_style, "conversation_id": "conv-77"}
    params = generation_body["disaggregated_params"]
    assert params["request_type"] == "generation_only" and params["schedule_style"] == schedule_style
    assert params["conversation_id"] == "conv-77"
    assert params["disagg_request_id"] == sent["disagg_request_id"]
    # The context sim's transceiver address, from the context answer or its /server_info: never
    # its HTTP URL.
    assert params["ctx_info_endpoint"] == transceiver(cluster.context)
    if schedule_style == "context_first":
        assert params["ctx_usage"]["prompt_tokens"] == response.json()["usage"]["input_tokens"]
        assert params["encoded_opaque_state"] and generation_body["prompt_token_ids"]
    else:
        assert params["ctx_request_id"] == sent["disagg_request_id"] and params["ctx_dp_rank"] == 0
        assert "encoded_opaque_state" not in params
    row = audit_row(response.headers["request-id"])
    assert row.status == "completed"
    assert {r.outcome for r in reservations_closed(row.request_id)} == {"success"}


@pytest.mark.parametrize("pool_key,why", [("not-the-workers-key", "does not share"), ("", "has no handoff signing key")])
def test_a_pool_without_the_workers_key_fails_cleanly(
    transactional_db: Any, gateway: Gateway, sim_pair: Callable[..., tuple[SimWorker, SimWorker]], schedule_style: str,
    pool_key: str, why: str,
) -> None:
    # Own sims with a short KV timeout: a refused context-first handoff stays held until then.
    context, generation = sim_pair("trtllm", kv_timeout=2)
    cluster = register_cluster(context, generation, schedule_style=schedule_style, signing_key=pool_key)
    wait_registered(gateway, cluster)
    response = post(gateway, cluster, "hello [sim tokens=3]")
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "api_error"
    assert error["message"] == "the generation worker refused the gateway's handoff authentication"
    for internal in ("127.0.0.1", "tcp://", "sha256", SIGNING_KEY, "not-the-workers-key"):
        assert internal not in response.text
    row = audit_row(response.headers["request-id"])
    assert row.status == "failed" and row.http_status == 500
    # Generation first: the refusal may come while the context phase still runs.
    assert row.stage == "generation" if schedule_style == "context_first" else row.stage in ("context", "generation")
    assert why in row.error_message and "Invalid internal disaggregated request authentication" in row.error_message
    assert pool_key == "" or pool_key not in row.error_message
    rows = reservations_closed(row.request_id)
    assert {r.stage for r in rows} == {"context", "generation"}
    assert any(r.outcome != "success" for r in rows)


def test_generation_first_fails_cleanly_when_server_info_is_down(
    transactional_db: Any, gateway: Gateway, generation_worker: SimWorker,
) -> None:
    from messages_api.auth import create_api_key
    from workers.models import WorkerEndpoint, WorkerPool

    pool = WorkerPool.objects.create(
        name="pool-no-server-info", model="no-server-info", schedule_style="generation_first", handoff_signing_key=SIGNING_KEY
    )
    # Nothing listens there: its /server_info cannot be read (and no probe has failed it yet).
    WorkerEndpoint.objects.create(pool=pool, role="context", url=refused_url())
    WorkerEndpoint.objects.create(pool=pool, role="generation", url=generation_worker.url)
    _, key = create_api_key(f"test-key-{time.monotonic_ns()}")
    cluster = Cluster(pool=pool, key=key, model=pool.model, context=generation_worker, generation=generation_worker)
    wait_registered(gateway, cluster)
    before = generation_worker.stats()["received"]
    response = post(gateway, cluster, "hello")
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "overloaded_error"
    assert "127.0.0.1" not in response.text and "server_info" not in response.text
    row = audit_row(response.headers["request-id"])
    assert row.status == "failed" and row.stage == "context"
    rows = reservations_closed(row.request_id)
    assert {r.stage for r in rows} == {"context", "generation"} and all(r.outcome != "success" for r in rows)
    assert generation_worker.stats()["received"] == before  # no generation request was sent


# --- the write-only key ----------------------------------------------------------------------------


def register(*args: str, **options: Any) -> str:
    out = io.StringIO()
    call_command("register_worker", "--pool", "p", "--model", "m", "--role", "context", "--url", "http://10.0.0.5:8001", *args,
                 stdout=out, **options)
    return out.getvalue()


@pytest.mark.django_db
def test_register_worker_sets_the_key_from_a_file_and_clears_it(tmp_path: Path) -> None:
    from workers.models import WorkerPool

    key_file = tmp_path / "key"
    key_file.write_text("s3cret-value\nignored\n")
    printed = register("--signing-key-file", str(key_file))
    assert WorkerPool.objects.get(name="p").handoff_signing_key == "s3cret-value"
    assert "s3cret" not in printed
    register("--signing-key-file", "-", stdin=io.StringIO("from-stdin\n"))
    assert WorkerPool.objects.get(name="p").handoff_signing_key == "from-stdin"
    register()  # no key option: kept
    assert WorkerPool.objects.get(name="p").handoff_signing_key == "from-stdin"
    register("--clear-signing-key")
    assert WorkerPool.objects.get(name="p").handoff_signing_key == ""
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(CommandError, match="empty"):
        register("--signing-key-file", str(tmp_path / "empty"))
    with pytest.raises(CommandError, match="cannot read"):
        register("--signing-key-file", str(tmp_path / "missing"))


@pytest.mark.django_db
def test_admin_never_shows_the_key_keeps_it_when_blank_and_clears_it_on_request() -> None:
    from django.contrib.auth.models import User

    from workers.models import WorkerPool

    User.objects.create_superuser("admin", "a@example.com", "pw")
    pool = WorkerPool.objects.create(name="kp", model="km", handoff_signing_key="very-secret-key")
    browser = Client()
    browser.force_login(User.objects.get(username="admin"))
    url = f"/admin/workers/workerpool/{pool.pk}/change/"
    page = browser.get(url)
    assert page.status_code == 200
    html = page.content.decode()
    assert "very-secret-key" not in html
    assert 'type="password"' in html and "signing key set" in html.lower()
    assert "very-secret-key" not in browser.get("/admin/workers/workerpool/").content.decode()

    form = {"name": "kp", "model": "km", "protocol": "trtllm", "schedule_style": "context_first", "routing": pool.routing,
            "max_local_prefill_tokens": "0", "cache_scope": "key", "handoff_signing_key": "",
            "endpoints-TOTAL_FORMS": "0", "endpoints-INITIAL_FORMS": "0", "endpoints-MIN_NUM_FORMS": "0",
            "endpoints-MAX_NUM_FORMS": "1000"}
    assert browser.post(url, form).status_code == 302
    assert WorkerPool.objects.get(pk=pool.pk).handoff_signing_key == "very-secret-key"
    assert browser.post(url, {**form, "handoff_signing_key": "new-key"}).status_code == 302
    assert WorkerPool.objects.get(pk=pool.pk).handoff_signing_key == "new-key"
    both = browser.post(url, {**form, "handoff_signing_key": "x", "clear_handoff_signing_key": "on"})
    assert both.status_code == 200 and WorkerPool.objects.get(pk=pool.pk).handoff_signing_key == "new-key"
    assert browser.post(url, {**form, "clear_handoff_signing_key": "on"}).status_code == 302
    assert WorkerPool.objects.get(pk=pool.pk).handoff_signing_key == ""


def test_quickstart_sims_and_pool_share_a_generated_key(transactional_db: Any) -> None:
    """`make run`'s quickstart: its simulated workers check signed handoffs, and the pool it
    registers signs with the same key, made for the run and shown nowhere."""
    import os
    import re
    import subprocess
    import sys

    from tests.support.gateway import DEFAULT_ENV, PROJECT_ROOT, test_database_url
    from workers.models import WorkerPool
    from workers.sim.process import stop_process

    port = unused_port()
    env = {**os.environ, **DEFAULT_ENV, "DJANGO_SETTINGS_MODULE": "disagg_project.test_settings",
           "DATABASE_URL": test_database_url(), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "manage.py", "quickstart", "--port", str(port), "--context-port", "0", "--generation-port", "0"],
        cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert process.stdout is not None
        printed = ""
        while "API key (shown once): " not in printed or "\n\nTry it" not in printed:
            line = process.stdout.readline()
            assert line, f"quickstart exited: {printed}"
            printed += line
        api_key = re.search(r"API key \(shown once\): (\S+)", printed).group(1)  # type: ignore[union-attr]
        generation_url = re.search(r"generation (http://\S+) \(pool", printed).group(1)  # type: ignore[union-attr]
        pool = WorkerPool.objects.get(name="local-sim")
        assert len(pool.handoff_signing_key) >= 32 and pool.handoff_signing_key not in printed
        gateway = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(gateway), timeout=20, message="quickstart's gateway never answered")
        headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
        payload = {"model": "sim-model", "max_tokens": 16, "messages": [{"role": "user", "content": "hi [sim tokens=3]"}]}
        response = httpx.post(gateway + "/v1/messages", json=payload, headers=headers, timeout=30, trust_env=False)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["output_tokens"] == 3
        # The sims do check: an unsigned handoff is refused.
        params = {"request_type": "generation_only", "ctx_request_id": 1, "disagg_request_id": 1, "ctx_info_endpoint": "tcp://127.0.0.1:1"}
        unsigned = httpx.post(generation_url + "/v1/chat/completions", json={**CHAT, "disaggregated_params": params}, timeout=10, trust_env=False)
        assert unsigned.status_code == 400 and "authentication" in unsigned.text
    finally:
        stop_process(process)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code < 500
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("schedule_style", ["context_first"])
def test_a_long_prompts_token_ids_reach_the_generation_worker_unchanged(gateway: Gateway, cluster: Cluster) -> None:
    """Thousands of ids are relayed as the context worker wrote them (workers.wire.raw_ints),
    never parsed into ints: the generation worker gets the same prompt, so the sim's answer (seeded
    by the prompt's ids) is the one it gives the same chat sent whole."""
    text = " ".join(f"w{i}" for i in range(3000)) + " [sim tokens=6]"
    response = post(gateway, cluster, text)
    assert response.status_code == 200, response.text
    context_body = cluster.context.requests()[-1]
    relayed = cluster.generation.requests()[-1]["prompt_token_ids"]
    assert len(relayed) > 3000 and all(type(i) is int for i in relayed)
    whole = {k: v for k, v in context_body.items() if k not in ("disaggregated_params", "stream_options")}
    whole.update(stream=False)
    direct = httpx.post(cluster.generation.url + "/v1/chat/completions", json=whole, timeout=30).json()
    said = "".join(block["text"] for block in response.json()["content"] if block["type"] == "text")
    assert said == direct["choices"][0]["message"]["content"]


def test_a_context_endpoint_with_the_b64_option_relays_the_ids_as_one_base64_string(
    transactional_db: Any, gateway: Gateway, context_worker: SimWorker, generation_worker: SimWorker
) -> None:
    """`prompt_token_ids_b64: true` on the context endpoint: the context request asks for
    `return_prompt_token_ids_b64` (upstream's `gen_tokids_ctxbytes`), the context worker answers
    with one base64 int32 string, and the generation worker gets that string verbatim; it reads the
    same prompt, so the answer is the one the int array gives."""
    text = " ".join(f"w{i}" for i in range(3000)) + " [sim tokens=6]"
    said = {}
    for b64 in (False, True):
        cluster = register_cluster(
            context_worker, generation_worker, context_options={"prompt_token_ids_b64": True} if b64 else {}
        )
        wait_registered(gateway, cluster)
        response = post(gateway, cluster, text)
        assert response.status_code == 200, response.text
        said[b64] = "".join(block["text"] for block in response.json()["content"] if block["type"] == "text")
        asked = cluster.context.requests()[-1]["disaggregated_params"]
        relayed = cluster.generation.requests()[-1]
        if b64:
            assert asked["return_prompt_token_ids_b64"] is True
            assert "prompt_token_ids" not in relayed and len(relayed["prompt_token_ids_b64"]) > 3000 * 4
        else:
            assert "return_prompt_token_ids_b64" not in asked
            assert "prompt_token_ids_b64" not in relayed and len(relayed["prompt_token_ids"]) > 3000
        assert audit_row(response.headers["request-id"]).status == "completed"
        cluster.pool.delete()
    assert said[True] == said[False]


@given(st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), min_size=1, max_size=50))
def test_base64_of_int32s_passes_the_check(ids: list[int]) -> None:
    assert trtllm.is_int32_b64(encode_token_ids_b64(ids))  # as the sim's context worker writes them


@settings(max_examples=500)
@given(st.text(alphabet="AQIgw+/=-_ \n\"\\é", max_size=24))
def test_the_base64_check_passes_exactly_what_decodes_to_whole_int32s(text: str) -> None:
    try:  # the reference: a strict decode (alphabet only, padding only at the end and complete)
        raw = binascii.a2b_base64(text, strict_mode=True)
        expected = bool(raw) and len(raw) % 4 == 0
    except (binascii.Error, ValueError):
        expected = False
    assert trtllm.is_int32_b64(text) == expected


@pytest.mark.parametrize("b64", ["", "AQAAAA", "AQAAAAIA", "AQAA AAA=", "AQ==AAAA", "AQAAAA==\n", "AQAAAAIAAAA=\"", "AQAAAAIAAAA==="])
def test_a_prompt_token_ids_b64_that_is_not_whole_int32s_is_refused(b64: str) -> None:
    with pytest.raises(WorkerError) as raised:
        trtllm.read_context_response(context_answer(prompt_token_ids_b64=b64))
    assert raised.value.status == 502
