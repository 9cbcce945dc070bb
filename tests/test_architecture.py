"""The layering docs/ARCHITECTURE.md draws, held against the code: the import graph of rlhf_mlflow
(every import, also those inside functions, read with ast) has no cycle; each layer imports only
layers before it; only tracking imports mlflow; nothing that decides reads a world's secret; decisions
never import a model class (they take arrays, and at most objects of core/protocol.py); modules and
functions stay small."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "rlhf_mlflow")
LAYERS = ["core", "training", "world", "decisions", "evidence", "tracking", "steps", "cli"]
# what each layer may import besides itself (decisions and tracking never import world or training; evidence,
# which runs the models decisions decide about, imports core and decisions)
ALLOWED = {"core": set(), "training": {"core"}, "world": {"core", "training"}, "decisions": {"core"},
           "evidence": {"core", "decisions"}, "tracking": {"core"},
           "steps": {"core", "training", "world", "decisions", "evidence", "tracking"},
           "cli": {"core", "training", "world", "decisions", "evidence", "tracking", "steps"}}
MODEL_CLASSES = {"rlhf_mlflow.core." + m for m in
                 ("model", "reward_model", "rollout", "stacked_policy", "reward_ensemble", "own_models")}
"""Our models' classes and what runs them (own_models: them as implementations of core/protocol.py)."""
SHIMS = {"certify", "certify_table", "diagnostic", "label_requests", "repair_rm"}  # `python -m rlhf_mlflow.certify` / `.diagnostic`: thin cli shims
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 300, 60


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """rlhf_mlflow modules and external top-level packages a file imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            out |= {n for n in names if n in modules} or {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m if m.startswith("rlhf_mlflow") else m.split(".")[0] for m in out}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in SHIMS:
        return "cli"
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


GRAPH = {m: _imports(p, _modules()) for m, p in _modules().items()}


def test_every_module_sits_in_a_layer():
    assert not [m for m in GRAPH if m != "rlhf_mlflow" and _layer(m) is None]
    assert not [m for m in GRAPH for i in GRAPH[m] if i.startswith("rlhf_mlflow") and i not in GRAPH], \
        "an import of a module that does not exist"


def test_no_import_cycles():
    internal = {m: {i for i in deps if i in GRAPH and i != m and not m.startswith(i + ".")} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in internal[m]:
            assert state.get(n) != 1, "import cycle: " + " -> ".join(path[path.index(n):] + [n]) if n in path else n
            if n not in state:
                visit(n, path + [n])
        state[m] = 2
    for m in internal:
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_only_layers_before_them(layer):
    bad = [(m, i) for m, deps in GRAPH.items() if _layer(m) == layer for i in deps
           if i.startswith("rlhf_mlflow.") and _layer(i) not in ALLOWED[layer] | {layer}]
    assert not bad, bad


def _reach(module: str) -> set[str]:
    """Every rlhf_mlflow module `module` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for i in GRAPH.get(todo.pop(), ()):
            if i.startswith("rlhf_mlflow.") and i not in seen:
                seen.add(i)
                todo.append(i)
    return seen


def test_decisions_import_no_model_class():
    """Decision code takes arrays (and at most protocol objects typed by core/protocol.py), never our model
    classes: evidence/ runs the models; no module under decisions/ reaches one, directly or through core."""
    bad = {m: sorted(_reach(m) & MODEL_CLASSES) for m in GRAPH if _layer(m) == "decisions"}
    assert not {m: b for m, b in bad.items() if b}
    assert "rlhf_mlflow.core.model" in _reach("rlhf_mlflow.evidence.certify_evidence")  # the check can see one


def test_only_tracking_imports_mlflow_and_only_steps_and_cli_import_tracking():
    assert not [m for m, deps in GRAPH.items() if "mlflow" in deps and _layer(m) != "tracking"]
    assert not [m for m, deps in GRAPH.items() if any(_layer(i) == "tracking" for i in deps if i.startswith("rlhf"))
                and _layer(m) not in ("tracking", "steps", "cli")]


def test_nothing_that_decides_reads_the_oracle_or_the_secret():
    for m, path in _modules().items():
        if _layer(m) in ("core", "training", "decisions", "evidence", "tracking"):
            assert "rlhf_mlflow.world.oracle" not in GRAPH[m], m
            assert '"secret"' not in open(path).read() and "'secret'" not in open(path).read(), m


def test_core_training_decisions_and_evidence_load_without_mlflow():
    mods = [m for m in GRAPH if _layer(m) in ("core", "training", "decisions", "evidence")]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + "bad = [m for m in sys.modules if m == 'mlflow' or m.startswith('mlflow.')]\nassert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_modules_and_functions_stay_small():
    long_modules, long_functions = [], []
    for m, path in _modules().items():
        text = open(path).read()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append((m, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append((m, node.name, n))
    assert not long_modules and not long_functions, (long_modules, long_functions)
