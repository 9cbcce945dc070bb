"""MLproject entry point `correct` = `rlhf-mlflow correct`."""
from _run import run

if __name__ == "__main__":
    run("correct")
