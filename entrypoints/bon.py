"""MLproject entry point `bon` = `rlhf-mlflow bon`."""
from _run import run

if __name__ == "__main__":
    run("bon")
