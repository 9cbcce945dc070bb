"""`python -m rlhf_mlflow.repair_rm`: the portable reward-model repair, no MLflow (cli/portable.py);
the repair lives in training/repair_rm.py."""
import sys

from rlhf_mlflow.cli.portable import repair_main as main

if __name__ == "__main__":
    sys.exit(main())
