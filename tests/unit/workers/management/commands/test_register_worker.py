"""`register_worker --option`: an endpoint's protocol options, set the way an operator does."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from workers.models import WorkerEndpoint

pytestmark = pytest.mark.django_db


def register(*options: str) -> str:
    out = io.StringIO()
    call_command(
        "register_worker", "--pool", "sg", "--model", "m", "--role", "context", "--url", "http://10.0.0.9:30000",
        "--protocol", "sglang", "--schedule-style", "generation_first", *[f"--option={o}" for o in options], stdout=out,
    )
    return out.getvalue()


def endpoint_options() -> Any:
    return WorkerEndpoint.objects.get(url="http://10.0.0.9:30000").options


def test_options_are_json_values_set_merged_and_removed() -> None:
    register("bootstrap_port=8998")
    assert endpoint_options() == {"bootstrap_port": 8998}
    assert "already registered" in register("bootstrap_port=8998")  # idempotent
    register("note=rack 7")  # not JSON: kept as a string, merged with the rest
    assert endpoint_options() == {"bootstrap_port": 8998, "note": "rack 7"}
    register("note=")
    assert endpoint_options() == {"bootstrap_port": 8998}


def test_a_malformed_option_is_refused() -> None:
    with pytest.raises(CommandError, match="KEY=VALUE"):
        register("bootstrap_port")


def test_a_pool_whose_decode_servers_refuse_whole_requests_cannot_skip_the_context_phase() -> None:
    """SGLang decode servers refuse a request without a bootstrap room, so conditional
    disaggregation (short prompts sent whole to a generation endpoint) cannot work there: refused
    when configured, flagged by the system check, never discovered by a client's 400."""
    from django.core.checks import run_checks

    from workers import protocols
    from workers.models import WorkerPool

    register("bootstrap_port=8998")
    with pytest.raises(CommandError, match="cannot skip the context phase"):
        call_command("register_worker", "--pool", "sg", "--model", "m", "--role", "generation",
                     "--url", "http://10.0.0.9:30001", "--max-local-prefill-tokens", "512")  # fmt: skip
    WorkerPool.objects.filter(name="sg").update(max_local_prefill_tokens=512)  # as a raw edit could
    [error] = [e for e in run_checks() if e.id == "workers.E001"]
    assert "cannot skip the context phase" in error.msg
    # An engine whose generation servers take whole requests may skip it.
    assert protocols.misconfiguration("vllm", "context_first", 512) is None
    assert protocols.misconfiguration("sglang", "aggregated", 512) is None


def register_kv(*flags: str) -> str:
    out = io.StringIO()
    call_command(
        "register_worker", "--pool", "kv", "--model", "m", "--role", "generation", "--url", "http://10.0.0.7:8000",
        "--protocol", "vllm", *flags, stdout=out,
    )
    return out.getvalue()


def kv_endpoint() -> WorkerEndpoint:
    return WorkerEndpoint.objects.get(url="http://10.0.0.7:8000")


def test_kv_event_settings_are_set_changed_and_cleared() -> None:
    register_kv()
    assert kv_endpoint().kv_events_address == ""  # not given: the approximate index
    out = register_kv(
        "--kv-events", "tcp://10.0.0.7:5557", "--kv-events-replay", "tcp://10.0.0.7:5558", "--kv-events-topic", "kv@a",
        "--kv-block-size", "32", "--kv-hash-algorithm", "sha256_cbor", "--kv-hash-seed", "0",
    )
    assert out.startswith("registered")
    endpoint = kv_endpoint()
    assert (endpoint.kv_events_address, endpoint.kv_events_replay_address, endpoint.kv_events_topic) == (
        "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "kv@a",
    )
    assert (endpoint.kv_block_size, endpoint.kv_hash_algorithm, endpoint.kv_hash_seed) == (32, "sha256_cbor", "0")
    assert register_kv("--kv-events", "tcp://10.0.0.7:5557", "--kv-block-size", "32").startswith("already registered")
    # Flags not given leave their fields; "none" and 0 clear.
    register_kv("--kv-hash-algorithm", "none", "--kv-block-size", "0")
    endpoint = kv_endpoint()
    assert (endpoint.kv_hash_algorithm, endpoint.kv_block_size, endpoint.kv_events_topic) == ("", None, "kv@a")
    register_kv("--kv-events-replay", "", "--kv-events", "")
    assert (kv_endpoint().kv_events_address, kv_endpoint().kv_events_replay_address) == ("", "")


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (("--kv-events", "tcp://*:5557"), "--kv-events: The engine's address and port to connect to"),
        (("--kv-events", "http://10.0.0.7:5557"), "--kv-events: A ZeroMQ address"),
        (("--kv-events-replay", "tcp://10.0.0.7:5558"), "--kv-events-replay: A replay address needs the KV-event address too."),
    ],
)
def test_kv_event_settings_are_checked_as_the_admin_checks_them(flags: tuple[str, ...], problem: str) -> None:
    register_kv()
    with pytest.raises(CommandError, match=problem.replace("(", r"\(")):
        register_kv(*flags)
    assert kv_endpoint().kv_events_address == ""  # nothing written


def test_an_unknown_hash_algorithm_is_refused_by_argparse() -> None:
    with pytest.raises(CommandError):
        register_kv("--kv-hash-algorithm", "md5")
