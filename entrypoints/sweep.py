"""MLproject entry point `sweep` = `rlhf-mlflow sweep`."""
from _run import run

if __name__ == "__main__":
    run("sweep")
