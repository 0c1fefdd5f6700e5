"""The `sarazmq` command line: one module per group of commands, registered here.

- `serve`: serve, api, keys (a deployment, its HTTP API, its keys)
- `client_commands`: generate, chat, health (against a deployment)
- `replay`, `replay_diff`, `capacity`: the trace replay harness (`workload_options` and
  `runs` are what they share)
- `simulate`: the same in simulated time (`sim_options`: what simulating commands share)
- `options`: options shared by several commands, each defined once
"""

from __future__ import annotations

import click

from sarazmq.cli.capacity import capacity
from sarazmq.cli.client_commands import chat, generate, health
from sarazmq.cli.profile import profile
from sarazmq.cli.replay import replay
from sarazmq.cli.replay_diff import replay_diff
from sarazmq.cli.serve import api, keys, serve
from sarazmq.cli.simulate import simulate
from sarazmq.cli.sweep import sweep


@click.group()
def main() -> None:
    """sarazmq: Sarathi-Serve style LLM serving over ZeroMQ."""


for _command in (serve, api, keys, health, generate, chat, replay, replay_diff, capacity, sweep):
    main.add_command(_command)
main.add_command(profile)
main.add_command(simulate)

__all__ = ["main"]
