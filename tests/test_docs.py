"""Every command and option of the CLI is named in the README (the README stays the manual)."""
import os

from rlhf_mlflow.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_command_and_option_is_in_the_readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    missing = []
    for name, cmd in cli.commands.items():
        if f"rlhf-mlflow {name}" not in readme:
            missing.append(name)
        for p in cmd.params:
            for opt in p.opts:
                if opt.startswith("--") and opt not in readme and opt.lstrip("-").replace("-", "_") not in readme:
                    missing.append(f"{name} {opt}")
    assert not missing, missing
