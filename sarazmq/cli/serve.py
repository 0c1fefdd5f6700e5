"""`sarazmq serve` (a multi-process deployment until SIGINT/SIGTERM), `sarazmq api` (the HTTP
API for a running deployment) and `sarazmq keys`."""

from __future__ import annotations

import signal
import sys
from typing import Any

import click

from sarazmq.cli.options import engine_config, engine_options, http_options, read_api_key
from sarazmq.config import (
    DEFAULT_CLIENT_TIMEOUT_S,
    DEFAULT_MODEL,
    LOAD_FORMATS,
    RESTART_POLICIES,
    CurveKeys,
    DeploymentConfig,
    EngineConfig,
)


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
@click.option(
    "--http-port",
    type=int,
    default=None,
    help="also serve the OpenAI-compatible HTTP API on this port",
)
@http_options
@click.option(
    "--nnodes",
    default=1,
    show_default=True,
    help="machines the deployment spans (the tp x pp workers split evenly over them)",
)
@click.option(
    "--node-rank",
    default=0,
    show_default=True,
    help="this machine's place: 0 = the head (frontend, scheduler, ...), r > 0 = only its workers",
)
@click.option(
    "--master-addr",
    default="127.0.0.1",
    show_default=True,
    help="the head's address, as every node reaches it (non-loopback needs --curve-key-file)",
)
@click.option(
    "--master-port",
    default=29500,
    show_default=True,
    help="torch.distributed's rendezvous on the head; the node link uses this port + 1",
)
@click.option(
    "--ready-timeout",
    default=600.0,
    show_default=True,
    help="seconds every process (and, multi-node, every node) gets to be ready",
)
@click.option("--log-level", default="WARNING", show_default=True)
def serve(
    endpoint: str | None,
    curve_key_file: str | None,
    restart: str,
    max_restarts: int,
    drain_timeout: float,
    client_timeout: float,
    http_port: int | None,
    http_host: str,
    api_key: str | None,
    api_key_file: str | None,
    max_body_mb: float,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    ready_timeout: float,
    log_level: str,
    **kw: Any,
) -> None:
    """Start a multi-process deployment and serve until SIGINT/SIGTERM.

    Over several machines: the same command on each, with --nnodes K, the head's
    --master-addr/--master-port, --node-rank 0 on the head and 1..K-1 on the others
    (which start only their workers and join the head), and the same --curve-key-file.

    Exits 0 after a requested stop (in-flight requests drained), 1 when a process died
    (and was not, or could no longer be, restarted) or the head refused this node."""
    from sarazmq.procs.launcher import Deployment, DeploymentError
    from sarazmq.resolve import describe_dtype

    config = engine_config(kw)
    key = read_api_key(api_key, api_key_file)
    curve = None
    try:
        if curve_key_file is not None:
            from sarazmq.keys import load_keypair

            public, secret = load_keypair(curve_key_file)
            curve = CurveKeys(public=public.decode(), secret=secret.decode())
        deployment = DeploymentConfig(
            endpoint=endpoint,
            num_detokenizers=kw["num_detokenizers"],
            curve=curve,
            log_level=log_level,
            restart=restart,
            max_restarts=max_restarts,
            drain_timeout=drain_timeout,
            client_timeout=client_timeout,
            http_port=http_port,
            http_host=http_host,
            api_key=key,
            max_body_mb=max_body_mb,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            ready_timeout=ready_timeout,
        )
        if node_rank > 0:
            if endpoint is not None or http_port is not None:
                raise ValueError("--endpoint and --http-port are the head's (--node-rank 0)")
            _serve_node(config, deployment)
            return
        dep = Deployment(config, deployment)
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
        f"sarazmq serving {dep.config.model} ({describe_dtype(config, dep.config)}, "
        f"{sched.policy}, chunk {sched.chunk_size}, "
        f"tp {dep.config.tensor_parallel_size} x pp {dep.config.pipeline_parallel_size}"
        + (f" over {nnodes} nodes" if nnodes > 1 else "")
        + (
            f", {dep.config.data_parallel_size} replicas ({dep.config.router} router)"
            if dep.config.data_parallel_size > 1
            else ""
        )
        + (
            f", disaggregated: {dep.config.prefill_instances} prefill + "
            f"{dep.config.decode_instances} decode instances"
            if dep.config.disaggregated
            else ""
        )
        + f", {dep.config.cache.num_blocks} KV blocks"
        + (" of int8" if dep.config.cache.kv_cache_dtype == "int8" else "")
        + ") on "
        f"{dep.endpoint}"
        + (" (CurveZMQ)" if curve else "")
        + (f", OpenAI API at {dep.http_url}" if dep.http_url else "")
        + f"; internal sockets in {dep.rundir}"
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


def _serve_node(config: EngineConfig, deployment: DeploymentConfig) -> None:
    """`sarazmq serve --node-rank r` (r > 0): this node's workers, joined to the head."""
    import logging

    from sarazmq.procs.node import NodeAgent, NodeRefused

    logging.basicConfig(
        level=deployment.log_level,
        format=f"%(asctime)s node-{deployment.node_rank} %(levelname)s %(message)s",
    )
    agent = NodeAgent(config, deployment)

    def on_signal(signum: int, _frame: Any) -> None:
        agent.request_stop()

    def on_ready(node: NodeAgent) -> None:
        click.echo(
            f"sarazmq node {deployment.node_rank} of {deployment.nnodes}: workers (ranks "
            f"{list(node.ranks)}) joined the head at {node.link}"
            + (" (CurveZMQ)" if deployment.curve else "")
        )
        sys.stdout.flush()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        code = agent.run(on_ready)
    except NodeRefused as e:
        raise click.ClickException(str(e)) from None
    if code:
        click.echo(f"sarazmq: node {deployment.node_rank}: {agent.failure}", err=True)
    else:
        click.echo(f"sarazmq: node {deployment.node_rank} stopped", err=True)
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


@click.command()
@click.option("--connect", required=True, help="public endpoint of a running deployment")
@click.option("--port", default=8000, show_default=True, help="HTTP port")
@http_options
@click.option(
    "--model",
    default=DEFAULT_MODEL,
    show_default=True,
    help="the deployment's model (its name is the served model id; its tokenizer shows "
    "logprob tokens)",
)
@click.option(
    "--load-format",
    default="auto",
    show_default=True,
    type=click.Choice(LOAD_FORMATS),
    help="as the deployment's (dummy: --model may name an architecture)",
)
@click.option("--max-model-len", default=0, show_default=True, help="0: the model's context")
@click.option(
    "--curve-server-key-file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="the deployment's public key file, for a CurveZMQ endpoint",
)
@click.option("--log-level", default="WARNING", show_default=True)
def api(
    connect: str,
    port: int,
    http_host: str,
    api_key: str | None,
    api_key_file: str | None,
    max_body_mb: float,
    model: str,
    load_format: str,
    max_model_len: int,
    curve_server_key_file: str | None,
    log_level: str,
) -> None:
    """Serve the OpenAI-compatible HTTP API for a running deployment (until Ctrl-C)."""
    import asyncio

    from sarazmq.api import APIConfig, HTTPBind, serve_http
    from sarazmq.cli.options import client_kwargs
    from sarazmq.model.loader import load_model_config, load_tokenizer, resolve_model
    from sarazmq.procs.endpoints import check_http_bind

    key = read_api_key(api_key, api_key_file)
    try:
        check_http_bind(http_host, key)
        source = resolve_model(model, load_format)
        context = max_model_len or load_model_config(source).max_position
        tokenizer = load_tokenizer(source)
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    config = APIConfig(
        endpoint=connect,
        model_name=model,
        max_model_len=context,
        api_key=key,
        max_body_bytes=int(max_body_mb * (1 << 20)),
        curve_server_key=client_kwargs(curve_server_key_file).get("curve_server_key"),
    )

    def listening() -> None:
        click.echo(f"sarazmq api: OpenAI API at http://{http_host}:{port}/v1 for {connect}")
        sys.stdout.flush()

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_http(config, HTTPBind(http_host, port), tokenizer, listening, log_level, stop)

    try:
        asyncio.run(run())
    except OSError as e:
        raise click.ClickException(f"cannot serve on {http_host}:{port}: {e}") from None
