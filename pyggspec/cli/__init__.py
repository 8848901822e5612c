"""Command line: ``pyggspec run | serve | bench | inspect | models | devices`` (thin; the work is in
the library).

Every :class:`PyggspecError` becomes one line on stderr and exit code 1; a usage error (an
unknown flag, a bad value) one line and exit code 2; anything else is reported as an internal error in one line (set ``PYGGSPEC_DEBUG=1``
for the traceback).

Layout: :mod:`~pyggspec.cli.common` defines every shared option once and turns their values
into an :class:`~pyggspec.config.EngineConfig`; ``run``, ``serve``, ``inspect`` and
``models``/``devices`` (``catalog``) are plain click commands that import only ``common``;
this module makes the group and adds them to it.
"""

from __future__ import annotations

import os
from typing import Any

import click

from pyggspec.cli import bench, catalog, inspect, run, serve
from pyggspec.cli.catalog import load_models
from pyggspec.cli.common import CONTEXT_SETTINGS
from pyggspec.errors import PyggspecError


class _Group(click.Group):
    """A click group that turns pyggspec errors into one line and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PyggspecError as e:
            click.echo(_one_line(str(e)), err=True)
            ctx.exit(1)
        except click.UsageError as e:  # a bad flag or value: one line, not click's usage
            where = e.ctx.command_path if e.ctx is not None else "pyggspec"
            click.echo(_one_line(f"pyggspec: {e.format_message()} (see {where} -h)"), err=True)
            ctx.exit(2)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("pyggspec: interrupted", err=True)
            ctx.exit(130)
        except Exception as e:
            if os.environ.get("PYGGSPEC_DEBUG"):
                raise
            click.echo(_one_line(f"pyggspec: internal error: {type(e).__name__}: {e} "
                                 "(PYGGSPEC_DEBUG=1 shows the traceback)"), err=True)
            ctx.exit(1)


def _one_line(msg: str) -> str:
    """``msg`` as one printable line: text from a damaged file can carry any bytes (newlines,
    terminal escapes) into a message; they are shown escaped."""
    if msg.isprintable():
        return msg
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg)


@click.group(cls=_Group, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="pyggspec", prog_name="pyggspec")
def main() -> None:
    """Qwen3.5/3.6 GGUF inference with MTP speculative decoding on ggml."""


# the package's attributes stay the modules (pyggspec.cli.run is the module, its command is
# pyggspec.cli.run.run)
for _cmd in (inspect.inspect, catalog.models, catalog.devices, run.run, serve.serve,
             bench.bench):
    main.add_command(_cmd)

__all__ = ["load_models", "main"]
