"""The README stays the manual and the docs stay true: every command and option of the CLI is named
in the README; every `rlhf-mlflow X` in the README and docs/ is a command; every relative link resolves."""
import glob
import os
import re

from rlhf_mlflow.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


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


def test_docs_name_only_real_commands_and_options():
    bad = []
    for page in PAGES:
        for line in open(page):
            for name, rest in re.findall(r"rlhf-mlflow ([a-z][a-z-]*)([^`|]*)", line):
                if name not in cli.commands:
                    bad.append((os.path.basename(page), name))
                    continue
                known = {o for p in cli.commands[name].params for o in p.opts + p.secondary_opts}  # --no-register
                bad += [(os.path.basename(page), name, o) for o in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest)
                        if o not in known]
    assert not bad, bad


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", open(page).read()):
            if not os.path.exists(os.path.join(os.path.dirname(page), target)):
                broken.append((os.path.basename(page), target))
    assert not broken, broken


def test_every_guarantee_names_a_test_that_exists():
    """README's Guarantees: each bullet names the test that holds it (`test_file.py::test_name`), and each
    named test is a test function of that file."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Guarantees"):readme.index("### Threat model")]
    bullets = [b for b in re.split(r"\n- ", section)[1:]]
    assert bullets and all("::test_" in b for b in bullets), [b[:80] for b in bullets if "::test_" not in b]
    missing = []
    for module, test in re.findall(r"(test_\w+\.py)::(test_\w+)", section):
        path = os.path.join(ROOT, "tests", module)
        if not os.path.exists(path) or not re.search(rf"^def {test}\(", open(path).read(), re.M):
            missing.append(f"{module}::{test}")
    assert not missing, missing
