"""The client-side commands: `generate`, `chat` and `health` (against a deployment)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import click

from sarazmq.cli.options import client_kwargs, engine_config, engine_options, server_key_option
from sarazmq.client import replica_summaries
from sarazmq.config import DeploymentConfig
from sarazmq.sampling_params import SamplingParams


@contextlib.contextmanager
def deployment_or_connect(connect: str | None, kw: dict[str, Any]) -> Iterator[str]:
    """Yields an endpoint: the given one, or one of a deployment started for this command."""
    if connect:
        yield connect
        return
    from sarazmq.procs.launcher import Deployment, DeploymentError

    config = engine_config(kw)
    click.echo(f"starting a deployment of {config.model} ...", err=True)
    try:
        dep = Deployment(config, DeploymentConfig(num_detokenizers=kw["num_detokenizers"]))
        dep.start()
    except (OSError, ValueError, DeploymentError) as e:
        raise click.ClickException(str(e)) from None
    try:
        yield dep.endpoint
    finally:
        dep.stop()


def _params(max_tokens: int, temperature: float, seed: int | None) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@click.command()
@click.argument("endpoint")
@click.option("--timeout", default=10.0, show_default=True)
@server_key_option
def health(endpoint: str, timeout: float, curve_server_key_file: str | None) -> None:
    """Check a deployment with a real one-token generation: exit 0 if healthy, else 1.

    The generation runs through every process, every worker rank and so every pipeline
    stage and node; a multi-node deployment also lists each node (its ranks, stages and
    last heartbeat), and a node that is not ready makes it unhealthy."""
    from sarazmq.client import Client

    with Client(endpoint, **client_kwargs(curve_server_key_file)) as client:
        report = client.health(timeout)
    if not report.healthy:
        click.echo(f"unhealthy: {report.reason}")
        sys.exit(1)
    stats = report.stats
    extra = ""
    if stats:
        extra = (
            f"; {stats.get('num_running', '?')} running, {stats.get('num_waiting', '?')} "
            f"waiting, {stats.get('num_free_blocks', '?')}/"
            f"{stats.get('num_total_blocks', '?')} KV blocks free"
        )
    nodes = stats.get("nodes") or []
    # a node down with data-parallel replicas leaves the others serving (its replicas
    # are listed as down below); without replicas the deployment needs every node
    down = [n for n in nodes if n.get("role") not in ("head", "replicas") and not n.get("ready")]
    if down:
        names = ", ".join(f"node {n.get('node')}" for n in down)
        click.echo(f"unhealthy: {names} not ready")
    else:
        click.echo(f"healthy: one token in {report.latency_s:.2f} s{extra}")
    for n in nodes:
        click.echo("  " + _node_line(n))
    for r in replica_summaries(stats.get("replicas") or []):
        click.echo("  " + _replica_line(r))
    sys.exit(1 if down else 0)


def _replica_line(r: dict[str, Any]) -> str:
    if not r["alive"]:
        return f"replica {r['instance']}: down"
    return (
        f"replica {r['instance']}: up, {r['num_running']} running, {r['num_waiting']} waiting, "
        f"{r['num_free_blocks']}/{r['num_total_blocks']} KV blocks free"
    )


def _node_line(node: dict[str, Any]) -> str:
    """One node of a multi-node deployment, as `health` lists it."""
    role = "head, " if node.get("role") == "head" else ""
    where = f"node {node.get('node')} ({role}{node.get('host') or '?'})"
    if "replicas" in node:  # data-parallel replicas: each node runs whole ones
        line = f"{where}: replicas {node.get('replicas')}"
    else:
        line = f"{where}: ranks {node.get('ranks')}, stages {node.get('stages')}"
    beat = node.get("last_heartbeat_s")
    if beat is not None:
        line += f", last heartbeat {beat:.1f} s ago"
    return line


@click.command()
@engine_options
@click.argument("prompt")
@click.option("--connect", default=None, help="endpoint of a running deployment")
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--sampling-seed", default=None, type=int, help="this request's sampling seed")
@click.option("--raw", is_flag=True, help="plain completion, no chat template")
@server_key_option
def generate(
    prompt: str,
    connect: str | None,
    max_tokens: int,
    temperature: float,
    sampling_seed: int | None,
    raw: bool,
    curve_server_key_file: str | None,
    **kw: Any,
) -> None:
    """Generate a reply to PROMPT, streamed to stdout."""
    from sarazmq.client import Client, EngineError

    params = _params(max_tokens, temperature, sampling_seed)
    ckw = client_kwargs(curve_server_key_file)
    with deployment_or_connect(connect, kw) as endpoint, Client(endpoint, **ckw) as client:
        try:
            if raw:
                deltas = client.stream(prompt, params)
            else:
                deltas = client.stream(None, params, messages=[{"role": "user", "content": prompt}])
            for delta in deltas:
                click.echo(delta.text, nl=False)
                sys.stdout.flush()
        except EngineError as e:
            raise click.ClickException(str(e)) from None
        click.echo()


@click.command()
@engine_options
@click.option("--connect", default=None, help="endpoint of a running deployment")
@click.option("--max-tokens", default=256, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--system", default=None, help="system prompt")
@server_key_option
def chat(
    connect: str | None,
    max_tokens: int,
    temperature: float,
    system: str | None,
    curve_server_key_file: str | None,
    **kw: Any,
) -> None:
    """Interactive multi-turn chat; /reset clears the history, /exit quits."""
    from sarazmq.client import Client, EngineError

    params = _params(max_tokens, temperature, None)
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    ckw = client_kwargs(curve_server_key_file)
    with deployment_or_connect(connect, kw) as endpoint, Client(endpoint, **ckw) as client:
        click.echo("chat ready: type a message, /reset to clear the history, /exit to quit")
        while True:
            try:
                line = input("you> ")
            except (EOFError, KeyboardInterrupt):
                click.echo()
                break
            text = line.strip()
            if not text:
                continue
            if text == "/exit":
                break
            if text == "/reset":
                history = list(base)
                click.echo("(history cleared)")
                continue
            history.append({"role": "user", "content": text})
            click.echo("assistant> ", nl=False)
            reply = ""
            try:
                for delta in client.stream(None, params, messages=history):
                    reply += delta.text
                    click.echo(delta.text, nl=False)
                    sys.stdout.flush()
            except EngineError as e:
                click.echo(f"\n[error: {e}]")
                history.pop()
                continue
            click.echo()
            history.append({"role": "assistant", "content": reply})
