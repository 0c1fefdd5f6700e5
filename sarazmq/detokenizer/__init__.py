"""The detokenizer process's room (one per shard of requests).

- `service.DetokenizerService`: scheduler deltas in, client text deltas and stop-string
  hits out.
- `incremental.IncrementalDetokenizer`: one request's tokens to safe text deltas.

The process loop is `sarazmq.procs.detokenizer`.
"""
