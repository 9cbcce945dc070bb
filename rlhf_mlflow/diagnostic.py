"""`python -m rlhf_mlflow.diagnostic`: the portable gold-free shortcut audit, no MLflow
(cli/portable.py); the audit lives in decisions/diagnostic.py."""
import sys

from rlhf_mlflow.cli.portable import diagnostic_main as main

if __name__ == "__main__":
    sys.exit(main())
