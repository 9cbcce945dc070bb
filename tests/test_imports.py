"""Only the tracking layer imports mlflow."""
import subprocess
import sys

CORE = ["vocab", "model", "reward_model", "data", "train_rm", "train_rl", "bon", "evaluate", "rl_math", "diagnostic",
        "certify", "guardrails", "ope_math", "correction", "reports",
        "world.build", "world.oracle", "world.corruptions"]


def test_core_modules_import_without_mlflow():
    code = ("import sys\n" + "".join(f"import rlhf_mlflow.{m}\n" for m in CORE)
            + "bad = [m for m in sys.modules if m == 'mlflow' or m.startswith('mlflow.')]\n"
              "assert not bad, bad\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
