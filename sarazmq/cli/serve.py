"""`sarazmq serve` (a multi-process deployment until SIGINT/SIGTERM) and `sarazmq keys`."""

from __future__ import annotations

import signal
import sys
from typing import Any

import click

from sarazmq.cli.options import engine_config, engine_options
from sarazmq.config import DEFAULT_CLIENT_TIMEOUT_S, RESTART_POLICIES, CurveKeys, DeploymentConfig


@click.command()
@engine_options
@click.option(
    "--endpoint",
    default=None,
    help="ipc://PATH or tcp://HOST:PORT (default: ipc in a private 0700 temp dir); a "
    "non-loopback tcp address needs --curve-key-file",
)
@click.option(
    "--curve-key-file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="the server's secret key file from `sarazmq keys` (mode 0600): clients must "
    "then know its public key (CurveZMQ)",
)
@click.option(
    "--restart",
    type=click.Choice(RESTART_POLICIES),
    default="no",
    show_default=True,
    help="when a process dies: exit non-zero, or start the deployment again",
)
@click.option("--max-restarts", default=3, show_default=True)
@click.option(
    "--drain-timeout",
    default=30.0,
    show_default=True,
    help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before being aborted",
)
@click.option(
    "--client-timeout",
    default=DEFAULT_CLIENT_TIMEOUT_S,
    show_default=True,
    help="seconds a client may leave heartbeats unanswered before its requests are aborted",
)
@click.option("--log-level", default="WARNING", show_default=True)
def serve(
    endpoint: str | None,
    curve_key_file: str | None,
    restart: str,
    max_restarts: int,
    drain_timeout: float,
    client_timeout: float,
    log_level: str,
    **kw: Any,
) -> None:
    """Start a multi-process deployment and serve until SIGINT/SIGTERM.

    Exits 0 after a requested stop (in-flight requests drained), 1 when a process died
    (and was not, or could no longer be, restarted)."""
    from sarazmq.procs.launcher import Deployment, DeploymentError

    config = engine_config(kw)
    curve = None
    try:
        if curve_key_file is not None:
            from sarazmq.keys import load_keypair

            public, secret = load_keypair(curve_key_file)
            curve = CurveKeys(public=public.decode(), secret=secret.decode())
        dep = Deployment(
            config,
            DeploymentConfig(
                endpoint=endpoint,
                num_detokenizers=kw["num_detokenizers"],
                curve=curve,
                log_level=log_level,
                restart=restart,
                max_restarts=max_restarts,
                drain_timeout=drain_timeout,
                client_timeout=client_timeout,
            ),
        )
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None

    def on_signal(signum: int, _frame: Any) -> None:
        dep.request_stop()  # the main loop below drains and stops

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        dep.start()
    except DeploymentError as e:
        raise click.ClickException(str(e)) from None
    sched = dep.config.scheduler
    click.echo(
        f"sarazmq serving {dep.config.model} ({sched.policy}, chunk {sched.chunk_size}, "
        f"tp {dep.config.tensor_parallel_size}, {dep.config.cache.num_blocks} KV blocks) on "
        f"{dep.endpoint}" + (" (CurveZMQ)" if curve else "") + f"; internal sockets in {dep.rundir}"
    )
    sys.stdout.flush()
    while not dep.done:
        dep.wait(0.2)  # short waits, so the signal handlers run promptly
    code = dep.wait()
    if code:
        click.echo(f"sarazmq: {dep.failure}", err=True)
    dep.stop()
    if not code:
        drained = (
            f"drained ({dep.drained.num_finished} finished, {dep.drained.num_aborted} aborted)"
            if dep.drained is not None
            else "not drained"
        )
        bad = {name: rc for name, rc in dep.exit_codes.items() if rc != 0}
        codes = f"exit codes {bad}" if bad else "every process exited 0"
        click.echo(f"sarazmq: {drained}; stopped, {codes}", err=True)
    sys.exit(code)


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="server", show_default=True)
def keys(directory: str, name: str) -> None:
    """Generate a CurveZMQ keypair: DIRECTORY/NAME.key (public, for clients) and
    DIRECTORY/NAME.key_secret (for `serve --curve-key-file`, mode 0600)."""
    from sarazmq.keys import create_keypair

    try:
        public, secret = create_keypair(directory, name)
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"public key: {public}\nsecret key: {secret}")
