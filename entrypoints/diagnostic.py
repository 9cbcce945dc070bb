"""MLproject entry point `diagnostic` = `rlhf-mlflow diagnostic`."""
from _run import run

if __name__ == "__main__":
    run("diagnostic")
