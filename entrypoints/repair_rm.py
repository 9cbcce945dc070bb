"""MLproject entry point `repair_rm` = `rlhf-mlflow repair-rm`."""
from _run import run

if __name__ == "__main__":
    run("repair-rm")
