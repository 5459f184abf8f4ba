"""workers.wire.redact: what a client, the audit row and the log see of a worker's error text."""

from __future__ import annotations

import pytest

from workers.wire.redact import CLIENT_LIMIT, audit_text, client_text, log_text, mask_credentials

# The probe from issue 9 (item 4): a FastAPI 500 carrying a traceback, an engine path, a peer's
# address and a key.
PROBE = """Traceback (most recent call last):
  File "/opt/tensorrt_llm/serve/openai_server.py", line 412, in openai_chat
    response = await self.llm.generate_async(prompt, sampling_params)
  File "/opt/tensorrt_llm/executor/result.py", line 88, in aresult
    raise RequestError(msg)
tensorrt_llm.executor.RequestError: KV transfer from 10.20.30.40:8001 failed (api_key=sk-internal-123, see /opt/tensorrt_llm/logs/kv.log)
"""


def test_the_probe_reaches_the_client_as_the_engine_message_alone() -> None:
    text = client_text(PROBE)
    assert text == "KV transfer from <address> failed (api_key=<redacted>, see <path>)"
    for leak in ("Traceback", "/opt", "tensorrt_llm", "10.20.30.40", "8001", "sk-internal", "line 412"):
        assert leak not in text


def test_the_audit_keeps_addresses_and_paths_and_masks_the_key() -> None:
    text = audit_text(PROBE)
    assert "10.20.30.40:8001" in text and "/opt/tensorrt_llm/logs/kv.log" in text and "Traceback" in text
    assert "sk-internal-123" not in text and "api_key=<redacted>" in text


def test_the_log_keeps_the_raw_text_bounded_on_one_line() -> None:
    assert log_text(PROBE) == PROBE.replace("\n", "\\n")
    assert len(log_text("x" * 100_000)) == 4096


def test_a_worker_cannot_forge_a_log_line_or_drive_the_terminal() -> None:
    forged = "bad gateway\n2026-12-05 06:00:00,000 INFO messages_api.access [req_x] ok\x1b[2J\u2028"
    line = log_text(forged)
    assert "\n" not in line and "\x1b" not in line and "\u2028" not in line
    assert line == "bad gateway\\n2026-12-05 06:00:00,000 INFO messages_api.access [req_x] ok\\x1b[2J\\u2028"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("connect to http://user:pw@worker-3.internal:8000/v1 failed", "connect to <url> failed"),
        ("peer gen-2.cluster.local:8001 is down", "peer <address> is down"),
        ("peer localhost:9000 and [fd00::1]:8000 and 10.0.0.7", "peer <address> and <address> and <address>"),
        ("Authorization: Bearer abc.def-ghi_jkl", "Authorization: Bearer <redacted>"),
        ("bad header bearer abcdefghij", "bad header bearer <redacted>"),
        ('{"password": "hunter2", "token": 5}', '{"password": "<redacted>", "token": 5}'),
        ("key hf_abcdefghijklmnop and ghp_abcdefghijklmnop", "key <redacted> and <redacted>"),
        ("aws AKIAABCDEFGHIJKLMNOP", "aws <redacted>"),
        ("weights at C:\\models\\llama\\x.bin missing", "weights at <path> missing"),
        ("cannot open ~/cache/model and ./a/b", "cannot open <path> and <path>"),
        ("multi\nline\tmessage\x00", "multi line message"),
        # Ordinary messages pass untouched.
        ("This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the completion).",
         "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the completion)."),
        ("max_tokens must be at least 1, got 0 (and/or 1/2 tokens/s)", "max_tokens must be at least 1, got 0 (and/or 1/2 tokens/s)"),
        ("Request timed out after 30.5 s", "Request timed out after 30.5 s"),
    ],
)
def test_client_text(raw: str, shown: str) -> None:
    assert client_text(raw) == shown


def test_a_traceback_without_a_message_leaves_only_the_prefix() -> None:
    assert client_text("Internal error: Traceback (most recent call last):\n  File \"/a/b.py\", line 1\nKeyError") == "Internal error:"


def test_chained_tracebacks_keep_the_last_exception() -> None:
    raw = PROBE + "\nDuring handling of the above exception, another exception occurred:\n\n" + PROBE.replace("KV transfer", "Retry")
    assert client_text(raw).startswith("Retry from <address> failed")


def test_client_text_is_bounded() -> None:
    text = client_text("word " * 1000)
    assert len(text) == CLIENT_LIMIT and text.endswith("…")


def test_mask_credentials_keeps_everything_else() -> None:
    assert mask_credentials("at 10.1.2.3:80 password=x /etc/y/z") == "at 10.1.2.3:80 password=<redacted> /etc/y/z"
