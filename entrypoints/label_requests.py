"""MLproject entry point `label_requests` = `rlhf-mlflow label-requests`."""
from _run import run

if __name__ == "__main__":
    run("label-requests")
