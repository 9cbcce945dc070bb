"""MLproject entry point `train_rl` = `rlhf-mlflow train-rl`."""
from _run import run

if __name__ == "__main__":
    run("train-rl")
