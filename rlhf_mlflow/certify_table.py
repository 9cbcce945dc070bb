"""`python -m rlhf_mlflow.certify_table`: a policy trained anywhere, certified from a table of its samples,
no MLflow (cli/portable.py); the estimator lives in decisions/table_certify.py."""
import sys

from rlhf_mlflow.cli.portable import certify_table_main as main

if __name__ == "__main__":
    sys.exit(main())
