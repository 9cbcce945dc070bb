"""MLproject entry point `replay_history` = `rlhf-mlflow replay-history`."""
from _run import run

if __name__ == "__main__":
    run("replay-history")
