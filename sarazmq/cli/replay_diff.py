"""`sarazmq replay-diff A B ...`: two (or more) replays of one workload, side by side."""

from __future__ import annotations

from pathlib import Path

import click

from sarazmq.replay.report import format_comparison, read_run, write_comparison


@click.command("replay-diff")
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option(
    "--name",
    "names",
    multiple=True,
    help="a label per run, in order (default: each directory's name)",
)
@click.option(
    "--baseline", default=None, help="the label ratios are taken against (default: the last)"
)
@click.option(
    "--output-dir", default=None, type=click.Path(file_okay=False), help="default: the first run"
)
def replay_diff(
    runs: tuple[str, ...], names: tuple[str, ...], baseline: str | None, output_dir: str | None
) -> None:
    """Compare replay output directories (e.g. sarazmq and vLLM on the same workload):
    prints the side-by-side table with ratios and writes comparison.json/.txt and
    overlaid TBT and TTFT CDFs."""
    if len(runs) < 2:
        raise click.BadParameter("give at least two run directories", param_hint="RUNS")
    labels = list(names) if names else [Path(r).name or r for r in runs]
    if len(labels) != len(runs) or len(set(labels)) != len(labels):
        raise click.BadParameter("give one distinct --name per run", param_hint="--name")
    summaries, records = {}, {}
    for label, run in zip(labels, runs):
        try:
            summaries[label], records[label] = read_run(run)
        except (OSError, ValueError, TypeError) as e:
            raise click.ClickException(f"{run}: {e}") from None
    base = baseline or labels[-1]
    if base not in summaries:
        raise click.BadParameter(f"{base!r} is not one of {labels}", param_hint="--baseline")
    out = Path(output_dir or runs[0]) / "diff"
    write_comparison(out, summaries, records, baseline=base)
    click.echo(format_comparison(summaries, base))
    click.echo(f"wrote {out}/comparison.json, comparison.txt, compare_*_cdf.png")
