"""The `sarazmq` command line: one module per group of commands, registered here.

- `serve`: serve, api, keys (a deployment, its HTTP API, its keys)
- `client_commands`: generate, chat, health (against a deployment)
- `replay`, `replay_diff`, `capacity`: the trace replay harness (`workload_options` and
  `runs` are what they share)
- `options`: options shared by several commands, each defined once
"""

from __future__ import annotations

import click

from sarazmq.cli.capacity import capacity
from sarazmq.cli.client_commands import chat, generate, health
from sarazmq.cli.replay import replay
from sarazmq.cli.replay_diff import replay_diff
from sarazmq.cli.serve import api, keys, serve


@click.group()
def main() -> None:
    """sarazmq: Sarathi-Serve style LLM serving over ZeroMQ."""


for _command in (serve, api, keys, health, generate, chat, replay, replay_diff, capacity):
    main.add_command(_command)

__all__ = ["main"]
