"""`sarazmq` command line: serve, chat, generate (and more added by later modules)."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

import click

from sarazmq.config import POLICIES, CacheConfig, EngineConfig, SchedulerConfig
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
            type=click.Choice(["auto", "torch", "flash_attn"]),
            default="auto",
            show_default=True,
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
    help="ipc://PATH or tcp://127.0.0.1:PORT (default: ipc in a private temp dir)",
)
@click.option("--log-level", default="WARNING", show_default=True)
def serve(endpoint: str | None, log_level: str, **kw: Any) -> None:
    """Start a multi-process deployment and serve until SIGINT/SIGTERM."""
    from sarazmq.procs.launcher import Deployment, DeploymentError

    try:
        dep = Deployment(
            build_config(kw),
            endpoint=endpoint,
            num_detokenizers=kw["detokenizers"],
            log_level=log_level,
        )
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    stop_requested = []

    def on_signal(signum: int, _frame: Any) -> None:
        stop_requested.append(signum)
        dep.stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        dep.start()
    except DeploymentError as e:
        raise click.ClickException(str(e)) from None
    click.echo(
        f"sarazmq serving {kw['model']} ({kw['policy']}, chunk {kw['chunk_size']}, "
        f"tp {kw['tp']}, {dep.config.cache.num_blocks} KV blocks) on {dep.endpoint}",
        err=False,
    )
    sys.stdout.flush()
    while not dep.done:
        dep.wait(0.2)  # short waits, so the signal handlers run promptly
    code = dep.wait()
    if code:
        click.echo(f"sarazmq: {dep.failure}", err=True)
    dep.stop()
    sys.exit(code)


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
def generate(
    prompt: str,
    connect: str | None,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    raw: bool,
    **kw: Any,
) -> None:
    """Generate a reply to PROMPT, streamed to stdout."""
    from sarazmq.client import Client, EngineError

    params = _params(max_tokens, temperature, seed)
    with deployment_or_connect(connect, kw) as endpoint, Client(endpoint) as client:
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
def chat(
    connect: str | None, max_tokens: int, temperature: float, system: str | None, **kw: Any
) -> None:
    """Interactive multi-turn chat; /reset clears the history, /exit quits."""
    from sarazmq.client import Client, EngineError

    params = _params(max_tokens, temperature, None)
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    with deployment_or_connect(connect, kw) as endpoint, Client(endpoint) as client:
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
    main()
