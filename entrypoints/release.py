"""MLproject entry point `release` = `rlhf-mlflow release`."""
from _run import run

if __name__ == "__main__":
    run("release")
