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
    interrupt (Ctrl-C, SIGTERM) into one line naming the run marked KILLED and how to go on with that
    command (interrupted_message), exit code 130."""

    def invoke(self, ctx):
        from rlhf_mlflow.core.process import killed_runs
        killed_runs.clear()  # this command's own runs only (a test process invokes many)
        try:
            return super().invoke(ctx)
        except InputError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            if e.filename is None:
                raise
            raise click.ClickException(f"{e.filename}: {e.strerror or e}") from None
        except KeyboardInterrupt:
            click.echo(interrupted_message(ctx.invoked_subcommand), err=True)
            ctx.exit(130)


def interrupted_message(command: str | None) -> str:
    """What an interrupted command says: its outermost run (marked KILLED) and how to go on, in that
    command's own words: train-rl and main resume, every other command starts again."""
    from rlhf_mlflow.core.process import killed_runs
    if not killed_runs:
        return f"interrupted: `rlhf-mlflow {command}` stopped; no MLflow run of it was running"
    run_id, step = killed_runs[-1]
    said = f"interrupted: the {step} run {run_id} is marked KILLED"
    if command == "train-rl":
        return f"{said}; continue it with `rlhf-mlflow train-rl --resume {run_id}`"
    if command == "main":
        return f"{said}; continue it with `rlhf-mlflow main --resume` and the same --out"
    return f"{said}; run `rlhf-mlflow {command}` again to start it over"


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
