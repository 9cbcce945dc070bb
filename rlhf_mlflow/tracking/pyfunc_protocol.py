"""An MLflow pyfunc model version as a policy of the model protocol (core/protocol.py), asked through
`predict` alone, so any flavour's model answers if it speaks the frame contract this project's own pyfunc
speaks (tracking/policy_model.py):

    predict(DataFrame[id, family, attrs], params={temperature, seed}) -> DataFrame[..., response, logprob]
        one sampled response per row (the seed's space-separated tokens) and its log-probability;
    predict(DataFrame[id, family, attrs, response]) -> the same columns, `response` as given and `logprob`
        its log-probability under the policy (nothing sampled).

`load` is the factory `--policy-impl rlhf_mlflow.tracking.pyfunc_protocol:load` names; `resolve` is how a step
opens what `--policy` names: a checkpoint directory or a models:/ / runs:/ URI of one of our versions as
our Policy (the same numbers as ever), any other logged model through `predict`. Its random stream is a
seed drawn from the caller's generator, so its samples are reproducible but not our sampler's."""
from __future__ import annotations

import mlflow
import pandas as pd
import torch

from rlhf_mlflow.core import protocol as P
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.own_models import POLICY_IMPL, open_policy
from rlhf_mlflow.tracking.policy_model import resolve_policy, response_ids


def _frame(prompts: torch.Tensor) -> pd.DataFrame:
    rows = [V.decode_prompt(p) for p in prompts.tolist()]
    return pd.DataFrame({"id": [f"row-{i}" for i in range(len(rows))], "family": [f for f, _ in rows],
                         "attrs": [a for _, a in rows]})


class PyfuncPolicy:
    """A loaded pyfunc model as a protocol Policy."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name

    def _predict(self, frame: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        out = self.model.predict(frame, params=params) if params else self.model.predict(frame)
        missing = {"response", "logprob"} - set(getattr(out, "columns", ()))
        if missing or len(out) != len(frame):
            raise InputError(f"{self.name}: predict must return a row per input row with 'response' and 'logprob' "
                             f"(core/protocol.py), got {type(out).__name__} missing {sorted(missing)}")
        return out

    def sample(self, prompts: torch.Tensor, n: int, temperature: float, generator: torch.Generator | None,
               logprobs: list | None = None) -> torch.Tensor:
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=generator))
        out = self._predict(_frame(prompts.repeat_interleave(n, 0)), {"temperature": float(temperature), "seed": seed})
        if logprobs is not None and temperature == 1.0:  # the distribution sampled from is the policy's
            logprobs.append(torch.tensor(out["logprob"].to_numpy(float)))
        return response_ids(out["response"], f"{self.name}: predict's")

    def logprobs(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        given = [" ".join(V.decode_response(y)) for y in responses.tolist()]
        out = self._predict(_frame(prompts).assign(response=given))
        if list(out["response"]) != given:
            raise InputError(f"{self.name}: predict sampled new responses where it was given some: it gives no "
                             "log-probabilities of given responses (a version logged before they were asked?)")
        return torch.tensor(out["logprob"].to_numpy(float))


def load(uri: str) -> PyfuncPolicy:
    """The pyfunc model at `uri` (models:/NAME/VERSION, runs:/..., a local path) as a protocol Policy."""
    try:
        return PyfuncPolicy(mlflow.pyfunc.load_model(uri), uri)
    except Exception as e:
        raise InputError(f"{uri}: cannot load the pyfunc model ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def resolve(policy: str, impl: str | None = None) -> tuple[P.Policy, str | None]:
    """(the policy `--policy` names, its LoggedModel id or None): a checkpoint directory (or whatever `impl`
    opens); a models:/ or runs:/ URI of one of our versions as our Policy, of any other model as a PyfuncPolicy
    (or through `impl`)."""
    if "://" not in policy and not policy.startswith("models:/"):
        return open_policy(policy, impl), None
    try:
        info = mlflow.models.get_model_info(policy)
    except Exception as e:
        raise InputError(f"{policy}: cannot resolve the model ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if impl and impl != POLICY_IMPL:
        return open_policy(policy, impl), info.model_id
    if "policy" in (info.flavors.get("python_function", {}).get("artifacts") or {}):
        local, model_id = resolve_policy(policy)
        return open_policy(local), model_id
    return load(policy), info.model_id
