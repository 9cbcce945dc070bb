"""`rlhf-mlflow`: one click command per MLproject entry point (and `runs`, `server`). Each command
parses and validates its options and calls one step function (rlhf_mlflow/steps/) with typed values."""
from __future__ import annotations

import logging
import os
import sys

import click

from rlhf_mlflow.cli import evaluate, history, labels, release, scale_out, tables, train, world
from rlhf_mlflow.core.errors import InputError


class Group(click.Group):
    """Turns InputError, and an OSError on a named file (a full disk, a vanished directory), into one
    clear error line (`Error: ...`, exit code 1; the step's run has already ended FAILED), and an
    interrupt (Ctrl-C, SIGTERM) into one line and exit code 130 (the run is already marked KILLED)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            if e.filename is None:
                raise
            raise click.ClickException(f"{e.filename}: {e.strerror or e}") from None
        except KeyboardInterrupt:
            click.echo("interrupted: the step's MLflow run is marked KILLED (a train-rl run continues with "
                       "`rlhf-mlflow train-rl --resume RUN_ID`)", err=True)
            ctx.exit(130)


@click.group(cls=Group)
@click.option("--quiet", "-q", is_flag=True, help="No progress lines or bars: results and errors only.")
def cli(quiet):
    """A small RLHF pipeline in pure PyTorch where every step is an MLflow run."""
    from rlhf_mlflow.core import process
    process.configure_threads()
    process.handle_signals()
    if quiet:
        os.environ[process.QUIET_ENV] = "1"  # worker processes inherit it
    logging.basicConfig(level=logging.WARNING if process.quiet() else logging.INFO, format="%(message)s",
                        stream=sys.stderr)


for _module in (world, train, evaluate, release, tables, labels, history, scale_out):
    for _command in _module.COMMANDS:
        cli.add_command(_command)
