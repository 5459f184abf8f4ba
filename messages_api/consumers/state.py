"""Where a consumer's response is: one state instead of a flag per step."""

from __future__ import annotations

import enum


class ResponseState(enum.Enum):
    """A consumer's response, which only moves forward:

        RECEIVING ─▶ ANSWERING ─▶ REPLYING ──▶ FINISHED     a JSON reply (an error's too)
                               └▶ STREAMING ─▶ FINISHED     an event stream

    RECEIVING  The body is being collected; nothing is sent. Only here is more body read.
    ANSWERING  The body is complete, or refused as too large, and the request's work runs;
               nothing is sent yet. An error now is answered as an HTTP error.
    REPLYING   A JSON reply's status line is being sent. An error now can only end its body.
    STREAMING  An event stream's status line is sent (or being sent). An error now is an
               `error` event that ends the stream.
    FINISHED   The last body frame is sent (or being sent): nothing more goes out, and the
               client's disconnect is the response's normal end, never a cancellation.

    Apart from the state: the status line sent (`ApiConsumer.sent_status`, a value for the audit
    row, set from REPLYING or STREAMING on), and whether a cancellation came from the key's
    revocation (`ApiConsumer.revoke`, only before FINISHED).
    """

    RECEIVING = enum.auto()
    ANSWERING = enum.auto()
    REPLYING = enum.auto()
    STREAMING = enum.auto()
    FINISHED = enum.auto()
