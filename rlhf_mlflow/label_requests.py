"""`python -m rlhf_mlflow.label_requests`: the portable label requests, no MLflow (cli/portable.py); the
draw lives in decisions/label_requests.py."""
import sys

from rlhf_mlflow.cli.portable import label_requests_main as main

if __name__ == "__main__":
    sys.exit(main())
