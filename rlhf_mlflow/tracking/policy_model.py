"""The policy as an MLflow pyfunc model: prompt records in, sampled responses and log-probs out (or the
log-probs of responses given with the prompts: the model protocol's two questions, core/protocol.py;
tracking/pyfunc_protocol.py asks them of any pyfunc model that answers them so).

The checkpoint travels inside the model as safetensors + config.json; the library code travels
with it (code_paths), so `mlflow.pyfunc.load_model` works wherever torch is installed.
"""
from __future__ import annotations

import os

import mlflow
import pandas as pd
from mlflow.models import ModelSignature, infer_signature
from mlflow.types.schema import ColSpec, Schema

from rlhf_mlflow.core import vocab as V

REGISTERED_MODEL = "rlhf-policy"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


MODEL_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "policy_pyfunc.py")


def generate(policy, frame: pd.DataFrame, temperature: float = 1.0, seed: int = 0) -> pd.DataFrame:
    """One response per row sampled at `temperature` (seeded), with its log-probability; or, where the
    frame gives every row a `response` (the seed's space-separated tokens), that response's log-probability
    under the policy (core/protocol.py's Policy.logprobs), nothing sampled."""
    import torch

    from rlhf_mlflow.core import model as M
    from rlhf_mlflow.core import records as D
    from rlhf_mlflow.core import rollout
    records = [{"id": str(r["id"]), "family": r["family"], "attrs": [int(a) for a in r["attrs"]]}
               for r in frame.to_dict("records")]
    for i, r in enumerate(records):
        D.check_record(r, f"model input row {i}", None)
    prompts = D.prompts_tensor(records)
    if "response" in frame.columns and len(frame) and frame["response"].notna().all():
        responses = response_ids(frame["response"], "model input")
    else:
        responses = rollout.sample(policy, prompts, 1, float(temperature), torch.Generator().manual_seed(int(seed)))
    logprobs = M.sequence_logprobs(policy, prompts, responses)
    return pd.DataFrame({"id": [r["id"] for r in records], "family": [r["family"] for r in records],
                         "response": [" ".join(V.decode_response(y)) for y in responses.tolist()],
                         "logprob": logprobs.tolist()})


def response_ids(column: pd.Series, where: str):
    """Responses as a frame gives them (the seed's space-separated content tokens), as ids (N, L);
    InputError naming `where` and the row."""
    import torch

    from rlhf_mlflow.core.errors import InputError
    out = []
    for i, text in enumerate(column):
        tokens = str(text).split()
        if len(tokens) != V.RESP_LEN or any(t not in V.CONTENT for t in tokens):
            raise InputError(f"{where} row {i}: 'response' must be {V.RESP_LEN} content tokens, got {text!r}")
        out.append(V.encode_response(tokens))
    return torch.tensor(out, dtype=torch.long).view(-1, V.RESP_LEN)


def signature(example: pd.DataFrame, output: pd.DataFrame) -> ModelSignature:
    """The pyfunc's signature: id, family, attrs in (and an optional `response`: score it, not sample), the
    sampled (or given) response and its log-probability out; `temperature` and `seed` as parameters."""
    inferred = infer_signature(example, output, params={"temperature": 1.0, "seed": 0})
    inputs = Schema([*inferred.inputs.inputs, ColSpec("string", "response", required=False)])
    return ModelSignature(inputs=inputs, outputs=inferred.outputs, params=inferred.params)


def log_policy(policy_dir: str, registered: bool = True, tags: dict | None = None, name: str = "policy"):
    """Log a policy checkpoint as a pyfunc model (a LoggedModel called `name`, e.g. its recipe) in the
    active run; register it as a new version of `rlhf-policy` when `registered`. Returns (ModelInfo,
    ModelVersion or None)."""
    from rlhf_mlflow.core import model as M
    policy, _ = M.load_policy(policy_dir)
    example = pd.DataFrame({"id": ["ex-0", "ex-1"], "family": ["anvil", "dune"], "attrs": [[0, 1, 2, 3], [7, 6, 5, 4]]})
    signature_ = signature(example, generate(policy, example))
    info = mlflow.pyfunc.log_model(
        # models from code: the model is defined by a source file, so loading it unpickles nothing
        name=name, python_model=MODEL_CODE, artifacts={"policy": policy_dir},
        code_paths=[PACKAGE_DIR], signature=signature_, input_example=example,
        pip_requirements=["torch==2.13.0", "safetensors", "numpy", "pandas"],
        registered_model_name=REGISTERED_MODEL if registered else None, tags=tags)
    version = None
    if registered:
        client = mlflow.MlflowClient()
        version = client.get_model_version(REGISTERED_MODEL, str(info.registered_model_version))
        for k, v in (tags or {}).items():
            client.set_model_version_tag(REGISTERED_MODEL, version.version, k, str(v))
    return info, version


def resolve_policy(policy: str) -> tuple[str, str | None]:
    """A checkpoint directory, or a models:/ or runs:/ URI of a logged policy -> (local checkpoint
    directory, the LoggedModel id or None)."""
    if "://" not in policy and not policy.startswith("models:/"):
        return policy, None
    from rlhf_mlflow.core.errors import InputError
    try:
        info = mlflow.models.get_model_info(policy)
        local = mlflow.artifacts.download_artifacts(policy)
    except Exception as e:
        raise InputError(f"{policy}: cannot resolve the model ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    # the checkpoint is the model's `policy` artifact; its folder is named after the logged directory
    rel = info.flavors["python_function"]["artifacts"]["policy"]["path"]
    return os.path.join(local, rel), info.model_id
