"""Prefill/decode disaggregation on real vLLM (CPU, NixlConnector over DRAM): does it work on this
machine, what does the prefill answer hand over, how long does decode take, does it stall?

    make vllm
    .venv/bin/python bench/pd_vllm.py [--runs 5] [--max-tokens 16]

Two real servers (tests/support/realvllm/pd.py, the tiny model), both `kv_both` with NixlConnector and
a CPU KV buffer, each with its own NIXL side-channel port. Each run sends what a disaggregating
proxy sends (vLLM's own toy proxy, and the gateway's vLLM protocol): the prompt to the prefill
server with `max_tokens: 1` and `kv_transfer_params: {do_remote_decode: true}`, then the same
prompt, streamed, to the decode server with the `kv_transfer_params` the prefill answer carried
(the decode server pulls the KV blocks from the prefill server over NIXL). A fresh prompt per run,
so prefix caching never hides a transfer.

`--through-gateway` sends each run through the gateway instead, as Anthropic Messages: a daphne
gateway (its own SQLite database) with a `vllm` pool, context first, the prefill server as its
context endpoint and the decode server as its generation endpoint; the time is to the first
`content_block_delta` the client receives, and the decode server's log says whether it pulled
the KV (a decode without usable params logs "will not utilize KVTransfer").

Not gating (prints a table, writes bench/results/pd_vllm.json). A decode counts as stalled when
its first token takes longer than --stall-s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness as h  # noqa: E402
from bench.harness import write_result  # noqa: E402
from tests.support.realvllm.pd import KV_CONFIG, LATE_READ, NO_KV_TRANSFER, prompt, start_pair  # noqa: E402
from tests.support.realvllm.server import RealVllm, missing  # noqa: E402


def run_once(prefill: RealVllm, decode: RealVllm, run: int, max_tokens: int, stall_s: float) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt(run)}]
    started = time.monotonic()
    answer = httpx.post(
        prefill.url + "/v1/chat/completions",
        json={
            "model": prefill.model, "messages": messages, "max_tokens": 1, "stream": False, "temperature": 0,
            "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None,
            },
        },
        timeout=120,
    )  # fmt: skip
    prefill_s = time.monotonic() - started
    answer.raise_for_status()
    prefill_answer = answer.json()
    params = prefill_answer.get("kv_transfer_params")
    result: dict[str, Any] = {
        "run": run,
        "prompt_tokens": prefill_answer["usage"]["prompt_tokens"],
        "prefill_s": round(prefill_s, 3),
        "kv_transfer_params": params,
    }
    if not isinstance(params, dict):
        result["error"] = "the prefill answer carried no kv_transfer_params"
        return result
    decode_started = time.monotonic()
    first_token_s: float | None = None
    chunks = 0
    usage: dict[str, Any] | None = None
    with httpx.stream(
        "POST",
        decode.url + "/v1/chat/completions",
        json={
            "model": decode.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "kv_transfer_params": params,
        },
        timeout=300,
    ) as stream:  # fmt: skip
        if stream.status_code != 200:
            result["error"] = f"decode answered {stream.status_code}: {stream.read().decode(errors='replace')[:300]}"
            return result
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                chunks += 1
                if first_token_s is None and "role" not in chunk["choices"][0]["delta"]:
                    first_token_s = time.monotonic() - decode_started
    decode_s = time.monotonic() - decode_started
    result.update(
        decode_first_token_s=round(first_token_s, 3) if first_token_s is not None else None,
        decode_total_s=round(decode_s, 3),
        decode_chunks=chunks,
        decode_usage=usage,
        stalled=first_token_s is None or first_token_s > stall_s,
    )
    return result




def run_through_gateway(gateway_url: str, key: str, run: int, max_tokens: int, stall_s: float) -> dict[str, Any]:
    """One streamed Anthropic request through the gateway's vLLM pool; time to the first text."""
    started = time.monotonic()
    first_token_s: float | None = None
    deltas = 0
    usage: dict[str, Any] = {}
    with httpx.stream(
        "POST",
        gateway_url + "/v1/messages",
        headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        json={"model": "tiny-llama", "max_tokens": max_tokens, "stream": True, "temperature": 0,
              "messages": [{"role": "user", "content": prompt(run)}]},
        timeout=300,
    ) as stream:  # fmt: skip
        if stream.status_code != 200:
            return {"run": run, "error": f"gateway answered {stream.status_code}: {stream.read().decode(errors='replace')[:300]}"}
        event = ""
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event in ("content_block_delta", "message_start", "message_delta", "error"):
                data = json.loads(line[6:])
                if event == "error":
                    return {"run": run, "error": data["error"]["message"]}
                if event == "content_block_delta":
                    deltas += 1
                    if first_token_s is None:
                        first_token_s = time.monotonic() - started
                elif event == "message_start":
                    usage.update(data["message"]["usage"])
                else:
                    usage.update(data.get("usage") or {})
    total_s = time.monotonic() - started
    return {
        "run": run,
        "prompt_tokens": usage.get("input_tokens"),
        "prefill_s": None,
        "decode_first_token_s": round(first_token_s, 3) if first_token_s is not None else None,
        "decode_total_s": round(total_s, 3),
        "decode_chunks": deltas,
        "decode_usage": usage,
        "stalled": first_token_s is None or first_token_s > stall_s,
    }


def through_gateway(prefill: RealVllm, decode: RealVllm, args: argparse.Namespace) -> list[dict[str, Any]]:
    with h.Stack("pd_vllm") as stack:
        stack.migrate()
        pool = {"protocol": "vllm", "schedule_style": "context_first"}
        stack.register_worker("pd", prefill.model, "context", prefill.url, **pool)
        stack.register_worker("pd", prefill.model, "generation", decode.url, **pool)
        key = stack.create_api_key("pd")
        gateway = stack.start_gateway({"WORKER_FIRST_BYTE_TIMEOUT_S": 300}, expect_pools=["pd"])
        return [run_through_gateway(f"http://127.0.0.1:{gateway.port}", key, run, args.max_tokens, args.stall_s) for run in range(args.runs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stall-s", type=float, default=10.0, help="a first decode token slower than this is a stall")
    parser.add_argument("--no-progress-thread", action="store_true", help="run NIXL without its busy-polling progress thread")
    parser.add_argument("--through-gateway", action="store_true", help="send each run through the gateway's vLLM pool, as Anthropic Messages")
    args = parser.parse_args()
    reason = missing()
    if reason is not None:
        raise SystemExit(reason)
    started = time.monotonic()
    prefill, decode = start_pair(progress_thread=not args.no_progress_thread)
    startup_s = time.monotonic() - started
    try:
        if args.through_gateway:
            results = through_gateway(prefill, decode, args)
        else:
            results = [run_once(prefill, decode, run, args.max_tokens, args.stall_s) for run in range(args.runs)]
        late_reads = sum(LATE_READ in line for line in prefill.log_path.read_text(errors="replace").splitlines())
        no_transfer = sum(NO_KV_TRANSFER in line for line in decode.log_path.read_text(errors="replace").splitlines())
    finally:
        prefill.stop()
        decode.stop()
    print(f"both servers up in {startup_s:.0f} s; logs: {prefill.log_path}, {decode.log_path}")
    print(f"{'run':>3} {'prompt':>6} {'prefill s':>9} {'1st token s':>11} {'decode s':>8} {'chunks':>6} stalled")
    for r in results:
        if "error" in r:
            print(f"{r['run']:>3} {r.get('prompt_tokens')!s:>6} {r.get('prefill_s')!s:>9} error: {r['error']}")
            continue
        print(
            f"{r['run']:>3} {r['prompt_tokens']!s:>6} {r['prefill_s']!s:>9} {r['decode_first_token_s']!s:>11} "
            f"{r['decode_total_s']:>8} {r['decode_chunks']:>6} {r['stalled']}"
        )
    print("kv_transfer_params of the first prefill answer:")
    print(json.dumps(results[0].get("kv_transfer_params"), indent=1))
    print(f"prefill server log lines '{LATE_READ}': {late_reads}")
    print(f"decode server log lines '{NO_KV_TRANSFER}' (a decode that prefilled itself): {no_transfer}")
    name = "pd_vllm" + ("-no-progress-thread" if args.no_progress_thread else "") + ("-gateway" if args.through_gateway else "")
    write_result(
        name,
        {"startup_s": round(startup_s, 1), "nixl_progress_thread": not args.no_progress_thread,
         "through_gateway": args.through_gateway, "runs": results, "late_kv_reads_logged": late_reads,
         "decodes_without_kv_transfer": no_transfer, "kv_config": KV_CONFIG},
    )  # fmt: skip


if __name__ == "__main__":
    main()
