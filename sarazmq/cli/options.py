"""Options shared by several commands, each defined once, and what they build."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import click

from sarazmq.config import EngineConfig
from sarazmq.options import EngineOptions, Flag, option_flags

Decorator = Callable[[Any], Any]


def stack(*options: Decorator) -> Decorator:
    """One decorator applying `options` in the order given (first = first in --help)."""

    def deco(f: Any) -> Any:
        for opt in reversed(options):
            f = opt(f)
        return f

    return deco


_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}


def _click_option(f: dataclasses.Field[Any], flag: Flag, *, sim: bool) -> Decorator:
    """The click option of one `EngineOptions` field (its parameter named as the field)."""
    text = (flag.sim_help or flag.help) if sim else flag.help
    if f.type == "bool":
        if flag.negative:
            return click.option(
                f"{flag.name}/{flag.negative}", f.name, default=f.default, show_default=True,
                help=text,
            )  # fmt: skip
        return click.option(flag.name, f.name, is_flag=True, default=f.default, help=text)
    kind: Any = click.Choice(flag.choices) if flag.choices else _TYPES[str(f.type)]
    return click.option(
        flag.name, f.name, type=kind, default=f.default, show_default=True, help=text
    )


#: Every option that builds an EngineConfig (generated from `EngineOptions`), plus the
#: deployment's --detokenizers; `engine_config(kw)` turns a command's values into the config.
engine_options = stack(
    *(_click_option(f, flag, sim=False) for f, flag in option_flags()),
    click.option(
        "--detokenizers",
        "num_detokenizers",
        default=1,
        show_default=True,
        help="detokenizer processes",
    ),
)

#: The engine options a simulated engine takes (`simulate`; scheduling, KV geometry,
#: parallelism, seed), generated from the same fields with the simulator's help texts.
sim_engine_options = stack(
    *(_click_option(f, flag, sim=True) for f, flag in option_flags(sim_only=True))
)


def engine_options_of(kw: Mapping[str, Any], **overrides: Any) -> EngineOptions:
    """The `EngineOptions` among a command's values (`overrides` win), or a one-line click
    error naming the bad value."""
    try:
        return EngineOptions.from_mapping(kw, **overrides)
    except (TypeError, ValueError) as e:
        raise click.ClickException(str(e)) from None


def engine_config(kw: Mapping[str, Any], **overrides: Any) -> EngineConfig:
    """The EngineConfig of a command's engine options (`overrides` win), or a one-line
    click error naming the bad value."""
    try:
        return engine_options_of(kw, **overrides).to_config()
    except ValueError as e:
        raise click.ClickException(str(e)) from None


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


def read_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The HTTP API key from --api-key or --api-key-file (first line), or None."""
    if api_key and api_key_file:
        raise click.ClickException("give --api-key or --api-key-file, not both")
    if api_key_file is None:
        return api_key or None
    try:
        with open(api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as e:
        raise click.ClickException(f"cannot read --api-key-file: {e}") from None
    if not key:
        raise click.ClickException(f"--api-key-file {api_key_file} is empty")
    return key


#: The HTTP server's options (serve --http-port ..., and `sarazmq api`).
http_options = stack(
    click.option("--http-host", default="127.0.0.1", show_default=True, help="HTTP address"),
    click.option(
        "--api-key",
        default=None,
        help="bearer key the HTTP /v1/ routes require (required off loopback)",
    ),
    click.option(
        "--api-key-file",
        default=None,
        type=click.Path(exists=True, dir_okay=False),
        help="file whose first line is the API key",
    ),
    click.option(
        "--max-body-mb", default=4.0, show_default=True, help="largest HTTP request body (MiB)"
    ),
)
