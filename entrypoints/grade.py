"""MLproject entry point `grade` = `rlhf-mlflow grade`."""
from _run import run

if __name__ == "__main__":
    run("grade")
