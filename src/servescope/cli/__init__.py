"""The ``servescope`` command line: a thin typer app.

Each command group lives in its own module here and only parses flags, calls one
library function and prints the result. This module joins them and owns the exit-code
contract (as click's): 0 success; 2 for any servescope error or usage error, printed
as one ``servescope: error: ...`` line on stderr; 130 on Ctrl-C; 1 only for bugs,
which keep their traceback (without locals: those may hold API keys).
"""

from __future__ import annotations

import importlib
import sys

import typer
from typer._click import exceptions as click_exceptions  # typer >= 0.20 vendors click

from servescope import __version__
from servescope.errors import ServescopeError

#: Command modules, each exposing ``register(app)``. Listed explicitly (no plugin
#: discovery) so that ``--help`` shows the same commands on every machine.
COMMAND_MODULES = (
    "servescope.cli.catalog",  # gpus, models
    "servescope.cli.roofline",  # roofline
    "servescope.cli.tiles",  # tiles
    "servescope.cli.bench",  # bench, selftest
    "servescope.cli.telemetry",  # telemetry
    "servescope.cli.kernels",  # kernels
    "servescope.cli.main_job",  # run, diagnose, report, compare
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"servescope {__version__}")
        raise typer.Exit(0)


def build_app() -> typer.Typer:
    """Build the typer app with every command group registered."""
    app = typer.Typer(
        name="servescope",
        help="Why does your LLM server's throughput plateau? Load sweep + GPU telemetry + roofline + diagnosis.",
        no_args_is_help=True,
        pretty_exceptions_show_locals=False,
        add_completion=False,
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
        ),
    ) -> None:
        """servescope: diagnose LLM serving throughput plateaus with numbers as evidence."""

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)
    return app


def error_line(message: str) -> None:
    """Print one error line on stderr (the only way the CLI reports a user error)."""
    typer.echo(f"servescope: error: {message}", err=True)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app and map outcomes to exit codes."""
    app = build_app()
    try:
        rv = app(args=argv, standalone_mode=False)
    except ServescopeError as err:
        error_line(str(err))
        sys.exit(2)
    except click_exceptions.NoArgsIsHelpError:
        # Raised after the help text was printed for a bare command group: not an error.
        sys.exit(0)
    except click_exceptions.UsageError as err:
        ctx = getattr(err, "ctx", None)
        hint = f" (try '{ctx.command_path} --help')" if ctx is not None else ""
        error_line(err.format_message().splitlines()[0] + hint)
        sys.exit(2)
    except click_exceptions.ClickException as err:
        error_line(err.format_message().splitlines()[0])
        sys.exit(2)
    except typer.Exit as err:
        sys.exit(err.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        error_line("interrupted")
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
