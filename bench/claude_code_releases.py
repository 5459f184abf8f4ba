#!/usr/bin/env python
"""Every Claude Code release of the last months against the gateway: one per ISO week, the pinned
one and npm's `latest`, each installed and run, pass or fail.

    .venv/bin/python bench/claude_code_releases.py                    # six months: ~26 releases (~4 min)
    .venv/bin/python bench/claude_code_releases.py --limit 2          # the two newest weeks, pinned and latest
    .venv/bin/python bench/claude_code_releases.py --versions 2.1.250,latest,pinned

Claude Code publishes 2.1.x patch releases nearly daily, and users run whichever they updated to,
not the one CI pins (.ci/claude-code-version; CI also runs the newest, .ci/run). Which releases:
from `npm view @anthropic-ai/claude-code time --json`, those published in the last --since-days
days, the last published of each ISO week (UTC), plus the pinned one and `latest`. npm's time list
also holds old versions with recent dates (2.1.64 dated 2026-06-03, 1.0.114 dated 2026-07-22,
...: re-published or back-filled, not releases of that week); a version counts only when it is
newer than every version dated before it. --versions names releases outright (`pinned` and
`latest` resolve).

Each release is installed with npm into one scratch prefix (emptied between releases; npm's
downloads go to a scratch cache deleted after each install unless --keep-npm-cache: one release on
disk at a time, 200-400 MB installed plus its download), and run as the tests in
tests/e2e/test_claude_code.py run it (tests/support/claude_code.py's run_claude, a clean
environment, CLAUDE_CODE_PREFIX pointing at the scratch prefix) against one gateway
(tests/support/gateway.py's Gateway on a temporary SQLite database) in front of one pair of sim
workers with the large context the test module's `large_context_workers` starts, registered with
tests/support/cluster.py's register_cluster, and the model catalogue `make run` sets up
(quickstart's Claude names and patterns routed to the sim pool). Per release, three runs, each with
an API key of its own (the audit rows are told apart by key):

- request: tests/support/claude_code.py's capture_claude_code_request: `claude -p "Say hello"` against a local
  recorder; its first `POST /v1/messages` is checked in-process with the gateway's
  validate_messages_request and to_chat_request, and its shape kept (top-level fields,
  anthropic-beta values, roles, content block types, endpoints called) so that what a release
  changed shows next to the release before it.
- tool: `claude -p "Read the file [sim tool_call=Read]" --max-turns 4` with ANTHROPIC_MODEL and
  the alias variables set to the pool's model, checked as test_claude_code_runs_the_tool_the_sim_calls
  checks it (exit 0, success, 2 turns, the file's text in the tool result the workers got, the
  sim's answer printed).
- no-model-variables: the same task with no model variable and gateway model discovery on, checked
  as test_claude_code_with_no_model_variables_... checks it (only claude-* names asked, no 404,
  the catalogue cached).

A release fails when any run does; what failed is kept per run: the checks that did not hold, the
exit code, stderr's tail and the gateway's audit rows that did not complete (HTTP status, error
type and message). No network to Anthropic is expected (telemetry and the like fail quietly).
A failed install is the environment's (npm, the network), not the release's: `install-failed`.

Prints the table and writes bench/results/claude_code_releases.json (rewritten after each release,
so an interrupted run keeps what it tried).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

PACKAGE = "@anthropic-ai/claude-code"
PINNED_FILE = h.PROJECT_ROOT / ".ci" / "claude-code-version"
# As tests/e2e/test_claude_code.py's large_context_workers fixture: Claude Code's request is ~20k
# prompt tokens for the sim's tokenizer, above the shared sim workers' 4096-token context.
LARGE_CONTEXT_OPTIONS: dict[str, Any] = {
    "tokens_per_second": 2000,
    "prefill_tokens_per_second": 2_000_000,
    "max_context_tokens": 200_000,
    "kv_timeout": 30,
}
TOOL_PROMPT = "Read the file [sim tool_call=Read]"
DISCOVERY_ENV = {"CLAUDE_CODE_ENABLE_GATEWAY_MODEL_DISCOVERY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": ""}
NPM_TIMEOUT_S = 600


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--since-days", type=int, default=183, help="releases published in the last N days (default 183: six months)")
    parser.add_argument("--limit", type=int, help="only the N most recent weekly releases (the pinned one and latest are tried as well)")
    parser.add_argument("--versions", help="comma-separated releases to try instead of the weekly choice (`pinned` and `latest` resolve)")
    parser.add_argument("--keep-npm-cache", action="store_true",
                        help="download into npm's own cache and keep it (~180 MB per release; faster re-runs) instead of a scratch cache")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (database, scratch prefix, the runs' homes)")
    parser.add_argument("--name", default="claude_code_releases", help="result file name (default: claude_code_releases)")
    return parser.parse_args()


# --- which releases ----------------------------------------------------------------------------------


def npm_json(*args: str) -> Any:
    result = subprocess.run(["npm", "view", PACKAGE, *args, "--json"], capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"npm view {PACKAGE} {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
    return json.loads(result.stdout)


def semver(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def is_release(version: str) -> bool:
    """A plain x.y.z release (no prerelease or build suffix; npm's `created`/`modified` keys are not)."""
    parts = version.split(".")
    return len(parts) == 3 and all(part.isdigit() for part in parts)


def published_at(times: dict[str, str], version: str) -> dt.datetime | None:
    stamp = times.get(version)
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None


def choose(times: dict[str, str], since_days: int, limit: int | None) -> tuple[list[str], list[str]]:
    """The last in-order release of each ISO week of the window, oldest first, and the versions the
    window holds that were dated out of order (skipped)."""
    cutoff = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=since_days)
    dated = sorted((dt.datetime.fromisoformat(times[v].replace("Z", "+00:00")), v) for v in times if is_release(v))
    highest: tuple[int, ...] = ()
    weekly: dict[tuple[int, int], str] = {}
    skipped: list[str] = []
    for when, version in dated:
        in_order = semver(version) > highest
        highest = max(highest, semver(version))
        if when < cutoff:
            continue
        if not in_order:
            skipped.append(version)
            continue
        iso = when.isocalendar()
        weekly[(iso.year, iso.week)] = version  # dated order: the week's last wins
    picks = [weekly[week] for week in sorted(weekly)]
    if limit is not None:
        picks = picks[-limit:] if limit > 0 else []
    return picks, skipped


# --- one release: install ----------------------------------------------------------------------------


def install(version: str, prefix: Path, cache: Path | None) -> dict[str, Any]:
    """`npm install --prefix PREFIX @anthropic-ai/claude-code@VERSION` into an emptied prefix."""
    for leftover in ("node_modules", "package.json", "package-lock.json"):
        path = prefix / leftover
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    prefix.mkdir(parents=True, exist_ok=True)
    command = ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error"]
    if cache is not None:
        command += ["--cache", str(cache)]
    started = time.monotonic()
    try:
        result = subprocess.run([*command, f"{PACKAGE}@{version}"], capture_output=True, text=True, timeout=NPM_TIMEOUT_S, check=False)
        ok, tail = result.returncode == 0, (result.stdout + result.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        ok, tail = False, f"npm install timed out after {NPM_TIMEOUT_S} s"
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    from tests.support.claude_code import claude_bin, claude_version

    installed = claude_version()
    if ok and installed != version:
        ok, tail = False, f"npm installed {installed!r}, not {version}"
    if ok and not claude_bin().exists():
        ok, tail = False, f"no {claude_bin()} after the install"
    # The postinstall hard-links the platform package's binary as bin/claude.exe: each inode once.
    inodes = {(s.st_dev, s.st_ino): s.st_size for f in (prefix / "node_modules").rglob("*") if not f.is_symlink() and f.is_file() for s in [f.stat()]}
    size = sum(inodes.values())
    return {"ok": ok, "seconds": round(time.monotonic() - started, 1), "mib": round(size / 2**20), "log_tail": "" if ok else tail}


# --- one release: the runs ---------------------------------------------------------------------------


def new_key(name: str) -> str:
    from messages_api.auth import create_api_key

    return create_api_key(name)[1]


def audit(key_name: str) -> list[dict[str, Any]]:
    """The key's audit rows, once none is in progress (they are written a moment after the answer)."""
    from messages_api.models import MessageRequest
    from tests.support.cluster import wait_until

    rows = MessageRequest.objects.filter(api_key_name=key_name).order_by("id")
    try:
        wait_until(lambda: not rows.filter(status="in_progress").exists(), timeout=10, message="")
    except AssertionError:
        pass
    return [
        {"route": r.route, "model": r.model, "stream": r.stream, "status": r.status, "http_status": r.http_status,
         "error_type": r.error_type, "error_message": r.error_message[:500]}
        for r in rows
    ]


def bad_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["status"] != "completed" or (r["http_status"] or 200) >= 400]


def cli_run(gateway_url: str, key: str, prompt: str, workdir: Path, *extra: str, **options: Any) -> tuple[dict[str, Any], Any]:
    """run_claude, with what a report needs; the parsed JSON output (None if there is none)."""
    from tests.support.claude_code import run_claude

    started = time.monotonic()
    try:
        result = run_claude(gateway_url, key, prompt, workdir, *extra, **options)
    except subprocess.TimeoutExpired as timeout:
        stderr = timeout.stderr.decode(errors="replace") if isinstance(timeout.stderr, bytes) else (timeout.stderr or "")
        return {"exit": None, "seconds": round(time.monotonic() - started, 1), "stderr_tail": stderr[-1500:], "stdout_tail": "",
                "failed": [f"timed out after {timeout.timeout} s"]}, None
    record: dict[str, Any] = {"exit": result.returncode, "seconds": round(time.monotonic() - started, 1),
              "stderr_tail": result.stderr[-1500:], "stdout_tail": result.stdout[-1500:], "failed": []}
    try:
        output = json.loads(result.stdout)
    except ValueError:
        output = None
    if result.returncode != 0:
        record["failed"].append(f"exit {result.returncode}")
    if not isinstance(output, dict):
        record["failed"].append("no JSON result on stdout")
        return record, None
    record["output"] = {k: output.get(k) for k in ("subtype", "is_error", "num_turns", "result")}
    if output.get("subtype") != "success" or output.get("is_error") is not False:
        record["failed"].append(f"result {output.get('subtype')!r}, is_error {output.get('is_error')!r}: {str(output.get('result'))[:300]}")
    if output.get("num_turns") != 2:
        record["failed"].append(f"num_turns {output.get('num_turns')} (2 expected: the tool call, then the answer)")
    return record, output


def run_tool(gateway_url: str, cluster: Any, workdir: Path, version: str) -> dict[str, Any]:
    """test_claude_code_runs_the_tool_the_sim_calls's task and checks."""
    from tests.support.simworkers import requests_with, sim_output

    key_name = f"cc-{version}-tool"
    key = new_key(key_name)
    marker = f"gateway-tool-result-marker-{version}"
    (workdir / "project").mkdir(parents=True)
    (workdir / "project" / "Paris").write_text(f"{marker}\n")
    cluster.context.reset()
    cluster.generation.reset()
    record, output = cli_run(gateway_url, key, TOOL_PROMPT, workdir, "--max-turns", "4")
    generated = requests_with(cluster.generation, "[sim tool_call=Read]")
    if output is not None and not record["failed"]:
        if len(generated) < 2:
            record["failed"].append(f"{len(generated)} generation request(s) with the prompt, 2 expected")
        else:
            first, second = generated[-2:]
            results = [m for m in second["messages"] if m["role"] == "tool"]
            calls = [c for m in second["messages"] if m["role"] == "assistant" for c in m.get("tool_calls") or []]
            if [c["function"]["name"] for c in calls] != ["Read"]:
                record["failed"].append(f"tool calls in the history: {[c['function']['name'] for c in calls]}")
            if len(results) != 1 or marker not in str(results[0].get("content")):
                record["failed"].append("the file's text is not in the one tool result the worker got")
            if str(output.get("result", "")).strip() != sim_output(second):
                record["failed"].append("the printed result is not the sim's answer")
    record["audit"] = audit(key_name)
    record["audit_errors"] = bad_rows(record["audit"])
    if record["audit_errors"]:
        record["failed"].append(f"{len(record['audit_errors'])} audit row(s) not completed")
    return record


def run_no_model_variables(gateway_url: str, workdir: Path, version: str) -> dict[str, Any]:
    """test_claude_code_with_no_model_variables_...'s task and checks (the routes are set up once)."""
    from workers.management.commands import quickstart

    key_name = f"cc-{version}-nomodel"
    key = new_key(key_name)
    (workdir / "project").mkdir(parents=True)
    (workdir / "project" / "Paris").write_text("no model variables\n")
    record, _ = cli_run(gateway_url, key, TOOL_PROMPT, workdir, "--max-turns", "4", model=None, env=DISCOVERY_ENV)
    rows = audit(key_name)
    record["audit"] = rows
    record["audit_errors"] = bad_rows(rows)
    asked = sorted({r["model"] for r in rows})
    record["models_asked"] = asked
    if not asked:
        record["failed"].append("no request reached the gateway")
    elif not all(name.startswith("claude-") for name in asked):
        record["failed"].append(f"models asked: {asked}")
    if any(r["http_status"] == 404 for r in rows):
        record["failed"].append("a model was not found (404)")
    if record["audit_errors"] and not any("audit row" in f for f in record["failed"]):
        record["failed"].append(f"{len(record['audit_errors'])} audit row(s) not completed")
    cache = workdir / "home" / ".claude" / "cache" / "gateway-models.json"
    try:
        cached = json.loads(cache.read_text())
        ids = {m["id"] for m in cached["models"]}
        record["discovered"] = sorted(ids)
        if cached.get("baseUrl") != gateway_url or not ids >= {name for name, _ in quickstart.CLAUDE_MODELS}:
            record["failed"].append(f"discovery cached {sorted(ids)} for {cached.get('baseUrl')}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        record["failed"].append(f"no discovered catalogue ({type(error).__name__}: {error})"[:300])
    return record


def request_shape(request: dict[str, Any], captured: list[dict[str, Any]]) -> dict[str, Any]:
    """What a release's first Messages request looks like, for comparing releases."""
    headers = {k.lower(): v for k, v in request["headers"].items()}
    body = request["body"]
    messages = body.get("messages") or []
    blocks: set[str] = set()
    for message in messages:
        content = message.get("content")
        for block in content if isinstance(content, list) else []:
            blocks.add(str(block.get("type")))
            inner = block.get("content")
            for sub in inner if isinstance(inner, list) else []:
                blocks.add(f"{block.get('type')}/{sub.get('type')}")
    system = body.get("system")
    return {
        "path": request["path"],
        "user_agent": headers.get("user-agent"),
        "anthropic_version": headers.get("anthropic-version"),
        "betas": sorted(b.strip() for b in headers.get("anthropic-beta", "").split(",") if b.strip()),
        "headers": sorted(headers),
        "fields": sorted(body),
        "roles": sorted({str(m.get("role")) for m in messages}),
        "block_types": sorted(blocks),
        "system_blocks": sorted({str(b.get("type")) for b in system}) if isinstance(system, list) else type(system).__name__,
        "tools": len(body.get("tools") or []),
        "tool_types": sorted({str(t.get("type", "custom")) for t in body.get("tools") or []}),
        "thinking": (body.get("thinking") or {}).get("type"),
        "endpoints": sorted({f"{r['method']} {r['path'].split('?')[0]}" for r in captured}),
    }


def run_request(version: str, workdir: Path) -> dict[str, Any]:
    """capture_claude_code_request, then the gateway's validation and conversion in-process."""
    from messages_api.convert import to_chat_request
    from messages_api.errors import AnthropicError
    from messages_api.validation import validate_messages_request
    from tests.support.claude_code import capture_claude_code_request

    record: dict[str, Any] = {"failed": []}
    try:
        request, captured = capture_claude_code_request("Say hello")
    except (AssertionError, subprocess.TimeoutExpired) as error:
        record["failed"].append(f"capture: {str(error)[:1500]}")
        return record
    record["shape"] = request_shape(request, captured)
    try:
        to_chat_request(validate_messages_request(request["body"]))
    except AnthropicError as error:
        record["failed"].append(f"refused in-process: {error}")
    except Exception as error:  # a 500 from the converter is what this run is for
        record["failed"].append(f"conversion crashed: {type(error).__name__}: {error}")
        record["traceback"] = traceback.format_exc()[-3000:]
    if record["failed"]:
        record["body"] = request["body"]  # the evidence
    return record


def try_release(version: str, tags: list[str], times: dict[str, str], env: dict[str, Any]) -> dict[str, Any]:
    when = published_at(times, version)
    record: dict[str, Any] = {"version": version, "published": when.date().isoformat() if when else None, "tags": tags}
    print(f"\n== {version} ({record['published']}, {', '.join(tags)})", flush=True)
    tmp: Path = env["tmp"]
    cache = None if env["keep_npm_cache"] else tmp / "npm-cache"
    record["install"] = install(version, env["prefix"], cache)
    print(
        f"   install: {'ok' if record['install']['ok'] else 'FAILED'} in {record['install']['seconds']} s, {record['install']['mib']} MiB", flush=True
    )
    if not record["install"]["ok"]:
        record["result"] = "install-failed"
        record["failed"] = [f"install: {record['install']['log_tail'][-300:]}"]
        return record
    runs: dict[str, dict[str, Any]] = {}
    workdir = tmp / "runs" / version
    try:
        runs["request"] = run_request(version, workdir / "request")
        runs["tool"] = run_tool(env["gateway"].url, env["cluster"], workdir / "tool", version)
        runs["no_model_variables"] = run_no_model_variables(env["gateway"].url, workdir / "nomodel", version)
    except Exception as error:  # the bench's own fault: reported, and the next release still tried
        runs.setdefault("error", {"failed": [f"{type(error).__name__}: {error}"], "traceback": traceback.format_exc()[-3000:]})
    for name, run in runs.items():
        print(f"   {name}: {'ok' if not run['failed'] else 'FAILED: ' + '; '.join(run['failed'])}"
              + (f" ({run['seconds']} s)" if "seconds" in run else ""), flush=True)
    record["runs"] = runs
    record["failed"] = [f"{name}: {failure}" for name, run in runs.items() for failure in run["failed"]]
    record["result"] = "fail" if record["failed"] else "pass"
    if not env["keep"]:
        shutil.rmtree(workdir, ignore_errors=True)
    return record


# --- the table ---------------------------------------------------------------------------------------


def what_failed(record: dict[str, Any]) -> str:
    if record["result"] == "pass":
        return ""
    parts = []
    for name, run in (record.get("runs") or {}).items():
        if not run["failed"]:
            continue
        text = f"{name}: {run['failed'][0]}"
        errors = run.get("audit_errors") or []
        if errors:
            first = errors[0]
            text += f" [audit: {first['http_status']} {first['error_type']}: {first['error_message'][:120]}]"
        elif run.get("stderr_tail", "").strip():
            text += f" [stderr: {run['stderr_tail'].strip().splitlines()[-1][:120]}]"
        parts.append(text)
    return " | ".join(parts) or "; ".join(record.get("failed", []))[:300]


def shape_changes(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Per release, what its first request changed from the release before it (in version order)."""
    changes = []
    previous: dict[str, Any] | None = None
    for record in records:
        shape = ((record.get("runs") or {}).get("request") or {}).get("shape")
        if shape is None:
            continue
        if previous is not None:
            notes = []
            for field in ("fields", "betas", "headers", "roles", "block_types", "tool_types", "endpoints"):
                old, new = set(previous[field]), set(shape[field])
                if new - old:
                    notes.append(f"{field} +{sorted(new - old)}")
                if old - new:
                    notes.append(f"{field} -{sorted(old - new)}")
            for field in ("path", "anthropic_version", "system_blocks", "thinking", "tools"):
                if previous[field] != shape[field]:
                    notes.append(f"{field} {previous[field]!r} -> {shape[field]!r}")
            if notes:
                changes.append((record["version"], "; ".join(notes)))
        previous = shape
    return changes


def report(records: list[dict[str, Any]]) -> None:
    headers = ["version", "published", "why", "result", "what failed"]
    rows = [[r["version"], r["published"] or "?", ",".join(r["tags"]), r["result"], what_failed(r)] for r in records]
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers) - 1)]
    print("\nClaude Code releases against the gateway")
    for i, row in enumerate([headers, *rows]):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
        if i == 0:
            print("-" * (sum(widths) + 2 * len(widths) + len(headers[-1])))
    passed = sum(r["result"] == "pass" for r in records)
    print(f"\n{passed}/{len(records)} passed")
    changes = shape_changes(records)
    if changes:
        print("\nWhat each release changed in its first request (from the release tried before it):")
        for version, note in changes:
            print(f"  {version}: {note}")


# --- main --------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    pinned = PINNED_FILE.read_text().strip()
    times = npm_json("time")
    latest = npm_json("dist-tags")["latest"]
    skipped: list[str] = []
    wanted: dict[str, list[str]] = {}
    if args.versions:
        for item in (v.strip() for v in args.versions.split(",") if v.strip()):
            version = {"pinned": pinned, "latest": latest}.get(item, item)
            wanted.setdefault(version, []).append("asked" if item == version else item)
    else:
        picks, skipped = choose(times, args.since_days, args.limit)
        for version in picks:
            wanted.setdefault(version, []).append("weekly")
        wanted.setdefault(pinned, []).append("pinned")
        wanted.setdefault(latest, []).append("latest")
    unknown = [v for v in wanted if v not in times]
    if unknown:
        raise SystemExit(f"not published: {unknown}")
    versions = sorted(wanted, key=semver)
    free = shutil.disk_usage(h.PROJECT_ROOT).free / 2**30
    print(f"{len(versions)} releases to try: {', '.join(versions)}")
    if skipped:
        print(f"(dated in the window but older than a release before them, not tried: {', '.join(sorted(skipped, key=semver))})")
    print(f"pinned {pinned}, latest {latest}; {free:.0f} GiB free on the disk")

    tmp = Path(tempfile.mkdtemp(prefix="bench-claude-code-releases-"))
    prefix = tmp / "prefix"
    os.environ["CLAUDE_CODE_PREFIX"] = str(prefix)  # tests/support/claude_code.py: every run uses it
    os.environ["DJANGO_SETTINGS_MODULE"] = "disagg_project.test_settings"
    os.environ["DATABASE_URL"] = f"sqlite:///{tmp / 'gateway.sqlite3'}"
    import django

    django.setup()
    from django.core.management import call_command

    from tests.support.cluster import call_command_quietly, register_cluster, wait_registered, wait_until
    from tests.support.gateway import Gateway
    from tests.support.simworkers import start_simworker
    from workers.management.commands import quickstart

    call_command("migrate", "--noinput", verbosity=0)
    records: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    started = time.monotonic()
    context = generation = gateway = None
    try:
        context = start_simworker("context", **LARGE_CONTEXT_OPTIONS)
        generation = start_simworker("generation", **LARGE_CONTEXT_OPTIONS)
        gateway = Gateway().start()
        cluster = register_cluster(context, generation, schedule_style="context_first")
        wait_registered(gateway, cluster)
        for name, display_name in quickstart.CLAUDE_MODELS:
            call_command_quietly("model_route", name, pool=[cluster.pool.name], display_name=display_name)
        for pattern in quickstart.CLAUDE_PATTERNS:
            call_command_quietly("model_route", pattern, pool=[cluster.pool.name])
        import httpx

        wait_until(
            lambda: any(m["id"] == quickstart.CLAUDE_MODELS[0][0]
                        for m in httpx.get(gateway.url + "/v1/models", headers=cluster.headers(), timeout=5).json()["data"]),
            message="the gateway never listed the routed Claude names",
        )
        env = {"tmp": tmp, "prefix": prefix, "gateway": gateway, "cluster": cluster, "keep": args.keep, "keep_npm_cache": args.keep_npm_cache}
        for version in versions:
            records.append(try_release(version, wanted[version], times, env))
            result = {
                "pinned": pinned, "latest": latest, "since_days": args.since_days, "limit": args.limit,
                "asked": args.versions, "skipped_out_of_order": sorted(skipped, key=semver),
                "elapsed_s": round(time.monotonic() - started), "releases": records,
            }
            h.RESULTS_DIR.mkdir(parents=True, exist_ok=True)  # after each release, quietly: an interrupted run keeps it
            (h.RESULTS_DIR / f"{args.name}.json").write_text(
                json.dumps({"benchmark": args.name, "partial": True, **result}, indent=2, default=str) + "\n"
            )
    finally:
        for process in (gateway, generation, context):
            if process is not None:
                process.stop()
        if args.keep:
            print(f"(kept {tmp}; the gateway's log: {gateway.log_path if gateway else '-'})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report(records)
    if records:
        h.write_result(args.name, {**result, "partial": False})
    print(f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
