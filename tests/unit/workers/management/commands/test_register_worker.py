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
