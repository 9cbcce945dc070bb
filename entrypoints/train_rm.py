"""MLproject entry point `train_rm` = `rlhf-mlflow train-rm`."""
from _run import run

if __name__ == "__main__":
    run("train-rm")
