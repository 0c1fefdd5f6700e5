"""The detokenizer process's room (one per shard of requests).

- `service.DetokenizerService`: scheduler deltas in, client text deltas and stop-string
  hits out.
- `incremental.IncrementalDetokenizer`: one request's tokens to safe text deltas.

The process loop is `sarazmq.procs.detokenizer`.
"""

from sarazmq.detokenizer.incremental import IncrementalDetokenizer
from sarazmq.detokenizer.service import DetokenizerService

__all__ = [
    "DetokenizerService",
    "IncrementalDetokenizer",
]
