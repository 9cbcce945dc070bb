"""MLproject entry point `expert_label` = `rlhf-mlflow expert-label`."""
from _run import run

if __name__ == "__main__":
    run("expert-label")
