"""Text from outside — a client's model name, a worker's error body — made safe for one log line."""

from __future__ import annotations

__all__ = ["loggable"]

# C0 and C1 control characters, DEL, and the Unicode line and paragraph separators: each would let
# outside text end a log line (and forge the next) or drive the reader's terminal (ANSI escapes).
# Backslashes are doubled, so an escape in the log is never the sender's own.
_LOG_ESCAPES = {
    **{code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))},
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\t"): "\\t",
    ord("\\"): "\\\\",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def loggable(text: str) -> str:
    """`text` safe in one log line."""
    return text.translate(_LOG_ESCAPES)
