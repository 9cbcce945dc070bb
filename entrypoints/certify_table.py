"""MLproject entry point `certify_table` = `rlhf-mlflow certify-table`."""
from _run import run

if __name__ == "__main__":
    run("certify-table")
