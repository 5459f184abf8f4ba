"""The Channels consumers of the API routes.

    base.py       ApiConsumer: body collection with the size guard, the one error boundary,
                  JSON replies, authentication (every route's consumer subclasses it)
    dispatch.py   RequestTask: the work run in place without a channel layer, and the client's
                  disconnect that cancels it (the Channels copy pinned in relied_on.py)
    state.py      ResponseState: where a response is, and which steps are still open
    messages.py   MessagesConsumer (POST /v1/messages, streamed and not) and its FrameWriter
    catalogue.py  CountTokensConsumer and ModelsConsumer

A Messages request's work beyond HTTP (intake, pool, limits, run, settling) is
`messages_api.answer`'s, shared with the requests answered without HTTP.
"""

from messages_api.consumers.base import ApiConsumer
from messages_api.consumers.catalogue import CountTokensConsumer, ModelsConsumer
from messages_api.consumers.messages import FrameWriter, MessagesConsumer
from messages_api.consumers.state import ResponseState

__all__ = ["ApiConsumer", "CountTokensConsumer", "FrameWriter", "MessagesConsumer", "ModelsConsumer", "ResponseState"]
