"""MLproject entry point `build_world` = `rlhf-mlflow build-world`."""
from _run import run

if __name__ == "__main__":
    run("build-world")
