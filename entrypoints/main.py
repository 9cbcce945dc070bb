"""MLproject entry point `main` = `rlhf-mlflow main`."""
from _run import run

if __name__ == "__main__":
    run("main")
