"""`python -m rlhf_mlflow.certify`: the portable certification, no MLflow (cli/portable.py); the
estimator lives in decisions/certify.py."""
import sys

from rlhf_mlflow.cli.portable import certify_main as main

if __name__ == "__main__":
    sys.exit(main())
