"""MLflow "model from code" for the policy: loading it imports this file; nothing is unpickled."""
import mlflow
import pandas as pd

from rlhf_mlflow.tracking.policy_model import generate


class PolicyModel(mlflow.pyfunc.PythonModel):
    """predict(DataFrame[id, family, attrs]) -> DataFrame[id, family, response, logprob]."""

    def load_context(self, context):
        from rlhf_mlflow.core import model as M
        self.policy, _ = M.load_policy(context.artifacts["policy"])

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        return generate(self.policy, model_input, **(params or {}))


mlflow.models.set_model(PolicyModel())
