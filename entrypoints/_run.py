"""Shared by the entry-point scripts: run one `rlhf-mlflow` command with the given arguments."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(command: str) -> None:
    from rlhf_mlflow.tracking.launched_run import name_launched_run
    # before the arguments are parsed: a run that fails on them is still named after its step
    name_launched_run(command.replace("-", "_"))
    from rlhf_mlflow.cli import cli
    args = [a for a in sys.argv[1:]]
    # MLproject passes every parameter; an empty string means "not given"
    kept, i = [], 0
    while i < len(args):
        if i + 1 < len(args) and args[i].startswith("--") and args[i + 1] == "":
            i += 2
            continue
        kept.append(args[i])
        i += 1
    # click names the command itself after the program: `Usage: rlhf-mlflow train-rl [OPTIONS]`
    cli.main([command] + kept, prog_name="rlhf-mlflow")
