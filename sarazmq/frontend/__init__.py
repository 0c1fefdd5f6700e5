"""The frontend process's room: the public endpoint's socket-free logic.

- `service.FrontendService`: client frames in, scheduler messages and client replies out
  (`actions`: what it asks the loop to send; `rejects`: replies to invalid frames).
- `routes.Routes`: the requests in flight, the instance each runs on (the router's
  choice), moving unstarted ones off a dead instance; `fanout`: stats questions asked of
  every instance and their merged answer.
- `prompts.PromptTokenizer`: prompts (text, token ids, chat) to validated token ids.

The process loop is `sarazmq.procs.frontend`.
"""

from sarazmq.frontend.actions import (
    GONE_BACKLOG,
    GONE_TIMEOUT,
    GONE_UNREACHABLE,
    REJECT_MULTIPART,
    ClientReply,
    FrontendActions,
)
from sarazmq.frontend.prompts import PromptTokenizer
from sarazmq.frontend.service import FrontendService

__all__ = [
    "GONE_BACKLOG",
    "GONE_TIMEOUT",
    "GONE_UNREACHABLE",
    "REJECT_MULTIPART",
    "ClientReply",
    "FrontendActions",
    "FrontendService",
    "PromptTokenizer",
]
