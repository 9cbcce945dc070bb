"""MLproject entry point `certify` = `rlhf-mlflow certify`."""
from _run import run

if __name__ == "__main__":
    run("certify")
