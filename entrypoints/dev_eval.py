"""MLproject entry point `dev_eval` = `rlhf-mlflow dev-eval`."""
from _run import run

if __name__ == "__main__":
    run("dev-eval")
