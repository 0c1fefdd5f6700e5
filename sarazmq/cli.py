"""`sarazmq` command line: serve, chat, generate, health, keys (and more added by later
modules)."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

import click

from sarazmq.config import (
    ATTENTION_BACKENDS,
    POLICIES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from sarazmq.sampling_params import SamplingParams


def engine_options(f: Any) -> Any:
    """The options that build an EngineConfig, shared by every command that starts one."""
    opts = [
        click.option(
            "--model",
            default="smollm2-135m-instruct",
            show_default=True,
            help="model name, .gguf file, or Hugging Face folder",
        ),
        click.option(
            "--scheduler",
            "policy",
            type=click.Choice(POLICIES),
            default="sarathi",
            show_default=True,
        ),
        click.option(
            "--chunk-size", default=256, show_default=True, help="per-iteration token budget"
        ),
        click.option("--max-num-seqs", default=64, show_default=True),
        click.option("--tp", default=1, show_default=True, help="tensor-parallel workers"),
        click.option("--detokenizers", default=1, show_default=True),
        click.option(
            "--dtype",
            type=click.Choice(["float32", "bfloat16", "float16"]),
            default="float32",
            show_default=True,
        ),
        click.option("--block-size", default=16, show_default=True),
        click.option(
            "--num-kv-blocks",
            default=0,
            show_default=True,
            help="KV pool size in blocks (0 = from available memory)",
        ),
        click.option(
            "--max-model-len",
            default=0,
            show_default=True,
            help="longest prompt+output (0 = the model's context)",
        ),
        click.option(
            "--attention-backend",
            type=click.Choice(list(ATTENTION_BACKENDS)),
            default="auto",
            show_default=True,
        ),
        click.option(
            "--enforce-eager",
            is_flag=True,
            help="run the model op by op (no fused one-call decode step)",
        ),
        click.option("--device", default="auto", show_default=True),
        click.option(
            "--threads",
            default=0,
            show_default=True,
            help="torch threads per worker (0 = cores / tp)",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def build_config(kw: dict[str, Any]) -> EngineConfig:
    return EngineConfig(
        model=kw["model"],
        dtype=kw["dtype"],
        device=kw["device"],
        attention_backend=kw["attention_backend"],
        enforce_eager=kw["enforce_eager"],
        tensor_parallel_size=kw["tp"],
        num_threads=kw["threads"],
        scheduler=SchedulerConfig(
            policy=kw["policy"],
            chunk_size=kw["chunk_size"],
            max_num_seqs=kw["max_num_seqs"],
            max_model_len=kw["max_model_len"],
        ),
        cache=CacheConfig(block_size=kw["block_size"], num_blocks=kw["num_kv_blocks"]),
    )


def server_key_option(f: Any) -> Any:
    return click.option(
        "--curve-server-key-file",
        default=None,
        type=click.Path(exists=True, dir_okay=False),
        help="the server's public key file (from `sarazmq keys`), for a CurveZMQ endpoint",
    )(f)


def client_kwargs(curve_server_key_file: str | None) -> dict[str, Any]:
    """Client() keyword arguments for the --curve-server-key-file option."""
    if curve_server_key_file is None:
        return {}
    from sarazmq.keys import load_public_key

    try:
        return {"curve_server_key": load_public_key(curve_server_key_file)}
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None


@contextlib.contextmanager
def deployment_or_connect(connect: str | None, kw: dict[str, Any]) -> Iterator[str]:
    """Yields an endpoint: the given one, or one of a deployment started for this command."""
    if connect:
        yield connect
        return
    from sarazmq.procs.launcher import Deployment

    click.echo(f"starting a deployment of {kw['model']} ...", err=True)
    with Deployment(build_config(kw), num_detokenizers=kw["detokenizers"]) as dep:
        yield dep.endpoint


@click.group()
def main() -> None:
    """sarazmq: Sarathi-Serve style LLM serving over ZeroMQ."""


@main.command()
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
    type=click.Choice(["no", "on-failure"]),
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
    default=15.0,
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
    from sarazmq.procs.common import CurveKeys
    from sarazmq.procs.launcher import Deployment, DeploymentError

    curve = None
    try:
        if curve_key_file is not None:
            from sarazmq.keys import load_keypair

            public, secret = load_keypair(curve_key_file)
            curve = CurveKeys(public=public.decode(), secret=secret.decode())
        dep = Deployment(
            build_config(kw),
            endpoint=endpoint,
            num_detokenizers=kw["detokenizers"],
            curve=curve,
            log_level=log_level,
            restart=restart,
            max_restarts=max_restarts,
            drain_timeout=drain_timeout,
            client_timeout=client_timeout,
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
    click.echo(
        f"sarazmq serving {kw['model']} ({kw['policy']}, chunk {kw['chunk_size']}, "
        f"tp {kw['tp']}, {dep.config.cache.num_blocks} KV blocks) on {dep.endpoint}"
        + (" (CurveZMQ)" if curve else "")
        + f"; internal sockets in {dep.rundir}",
        err=False,
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


@main.command()
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


@main.command()
@click.argument("endpoint")
@click.option("--timeout", default=10.0, show_default=True)
@server_key_option
def health(endpoint: str, timeout: float, curve_server_key_file: str | None) -> None:
    """Check a deployment with a real one-token generation: exit 0 if healthy, else 1."""
    from sarazmq.client import Client

    with Client(endpoint, **client_kwargs(curve_server_key_file)) as client:
        report = client.health(timeout)
    if report.healthy:
        stats = report.stats
        extra = ""
        if stats:
            extra = (
                f"; {stats.get('num_running', '?')} running, {stats.get('num_waiting', '?')} "
                f"waiting, {stats.get('num_free_blocks', '?')}/"
                f"{stats.get('num_total_blocks', '?')} KV blocks free"
            )
        click.echo(f"healthy: one token in {report.latency_s:.2f} s{extra}")
        sys.exit(0)
    click.echo(f"unhealthy: {report.reason}")
    sys.exit(1)


def _params(max_tokens: int, temperature: float, seed: int | None) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@engine_options
@click.argument("prompt")
@click.option("--connect", default=None, help="endpoint of a running deployment")
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--seed", default=None, type=int)
@click.option("--raw", is_flag=True, help="plain completion, no chat template")
@server_key_option
def generate(
    prompt: str,
    connect: str | None,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    raw: bool,
    curve_server_key_file: str | None,
    **kw: Any,
) -> None:
    """Generate a reply to PROMPT, streamed to stdout."""
    from sarazmq.client import Client, EngineError

    params = _params(max_tokens, temperature, seed)
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


@main.command()
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


if __name__ == "__main__":
    # `python -m sarazmq.cli`: run the package module's group, which has the commands
    # of later modules (they import sarazmq.cli themselves, so registering them from
    # __main__ would import this file twice, circularly)
    from sarazmq.cli import main as package_main

    package_main()
else:
    from sarazmq.replay.cli import capacity, replay  # needs engine_options above

    main.add_command(replay)
    main.add_command(capacity)
