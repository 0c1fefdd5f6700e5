"""`sarazmq profile`: time a grid of iteration shapes on this machine's engine and fit its
latency model (the `--profile` input of the simulator)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from sarazmq.cli.options import engine_config, engine_options


@click.command()
@click.option(
    "--output",
    required=True,
    type=click.Path(dir_okay=False, writable=True),
    help="where to write the profile JSON",
)
@click.option("--quick", is_flag=True, help="a small grid (tests, smoke runs)")
@click.option(
    "--runs",
    default=3,
    show_default=True,
    type=click.IntRange(1, 20),
    help="timed runs per shape (median; long prefills get fewer)",
)
@click.option("--verbose", "-v", is_flag=True, help="print every shape's time")
@click.option(
    "--from-runs",
    "from_runs",
    multiple=True,
    type=click.Path(file_okay=False),
    help="instead of timing shapes: fit on the iterations of these replay output folders "
    "(repeat the option; the last one is held out for the error)",
)
@engine_options
def profile(
    output: str, quick: bool, runs: int, verbose: bool, from_runs: tuple[str, ...], **kw: Any
) -> None:
    """Time iterations of known shapes (prefill chunks 16..2048 at prior contexts up to 2048,
    decode batches 1..64 at contexts 64..2048, hybrids) with the engine built in process,
    fit the piecewise-linear latency model on 75 % of them and report its error on the
    rest. Writes OUTPUT: the machine probe, the engine, every sample, the model, the errors.
    Only the options that shape the model's work matter (--model, --dtype, --block-size,
    --threads, --attention-backend, --enforce-eager, --device, --max-model-len); a KV pool
    left to memory (--num-kv-blocks 0) is capped at 1 GiB."""
    from sarazmq.perf.profile import run_profile

    out = Path(output)
    if out.parent and not out.parent.is_dir():
        raise click.BadParameter(f"folder {out.parent} does not exist", param_hint="--output")
    if from_runs:
        _profile_from_runs(list(from_runs), out)
        return
    config = engine_config(kw)

    def say(msg: str) -> None:
        if verbose or not msg.startswith("["):
            click.echo(msg, err=True)

    try:
        result = run_profile(config, quick=quick, runs=runs, progress=say)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(str(e).splitlines()[0] if str(e) else repr(e)) from None
    _write(out, result.to_dict())
    m = result.model
    click.echo(
        f"{len(result.shapes)} shapes in {result.wall_s:.0f} s; model: knee {m.knee} tokens, "
        f"c0 {m.c0 * 1e3:.2f} ms, {m.c_tok * 1e6:.1f} us/token, "
        f"{m.c_pairs * 1e9:.2f} ns/prefill pair, {m.c_ctx * 1e9:.2f} ns/decode KV token, "
        f"{m.c_seq * 1e6:.1f} us/seq, {m.c_sampled * 1e6:.1f} us/sampled row"
    )
    click.echo(f"train error: {result.train_error}")
    click.echo(f"held-out error: {result.test_error}")
    click.echo(f"wrote {output}")
    sys.stdout.flush()


def _profile_from_runs(run_dirs: list[str], out: Path) -> None:
    from sarazmq.perf.from_runs import fit_from_runs

    try:
        data = fit_from_runs(run_dirs)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    _write(out, data)
    n = data["num_iterations"]
    err = data["error"]
    click.echo(
        f"fitted on {n['train']} iterations of {len(run_dirs) - 1} run(s); overhead between "
        f"iterations {data['overhead_s'] * 1e3:.2f} ms"
    )
    for name in ("train", "test"):
        e = err[name]
        click.echo(
            f"{'held-out' if name == 'test' else 'train'} error: n={e['n']} MAPE "
            f"{e['mape']:.1f}% P95 {e['p95_abs_pct_error']:.1f}% bias {e['bias_pct']:+.1f}%"
        )
    click.echo(f"wrote {out}")


def _write(out: Path, data: dict[str, Any]) -> None:
    try:
        out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    except OSError as e:
        raise click.ClickException(f"cannot write --output {out}: {e}") from None
