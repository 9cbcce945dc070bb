"""The small model protocol: what every step needs of a live policy or reward model, so that any
implementation (this project's models, a class of another stack named by an import path, an MLflow pyfunc
model) can be certified, watched, evaluated and audited.

Prompts and responses are the seed's token ids: prompts (N, P) as records.prompts_tensor makes them from
prompt records ([<family>, v_a1..v_a4, <sep>]), responses (N, L) of content tokens (vocab.CONTENT_ID).

    Policy.sample(prompts (B, P), n, temperature, generator, logprobs=None) -> responses (B*n, L)
        row i belongs to prompt i // n; `generator` is the caller's random stream (a policy that cannot
        draw from a torch.Generator may draw a seed from it); `logprobs`, when a list, may receive each
        response's sequence log-probability under the distribution sampled from ((B*n,) tensor): callers
        that find it empty ask `logprobs` for them.
    Policy.logprobs(prompts (N, P), responses (N, L)) -> (N,) log pi(response | prompt), exact.
    RewardModel.score(prompts (N, P), responses (N, L)) -> (N,) scores.

`sample`, `logprobs` and `score` below call an implementation and check what it returned (shape, token
range, finiteness), so that a broken one fails with a sentence naming it, not deep inside an estimator.
`load_impl` opens an implementation named by an import path, `package.module:factory`, the factory called
with the model's location (a directory, a file, a URI: whatever it understands)."""
from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

import torch

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError


@runtime_checkable
class Policy(Protocol):
    """A policy that samples responses to prompts and gives the log-probabilities of given responses."""

    def sample(self, prompts: torch.Tensor, n: int, temperature: float, generator: torch.Generator | None,
               logprobs: list | None = None) -> torch.Tensor: ...

    def logprobs(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class RewardModel(Protocol):
    """A reward model that scores (prompt, response) pairs."""

    def score(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor: ...


def _name(model) -> str:
    return getattr(model, "name", None) or type(model).__qualname__


def _rows(model, what: str, out, n: int) -> torch.Tensor:
    out = torch.as_tensor(out)
    if out.shape != (n,):
        raise InputError(f"{_name(model)}: {what} returned shape {tuple(out.shape)}, expected ({n},)")
    if not bool(torch.isfinite(out).all()):
        raise InputError(f"{_name(model)}: {what} returned a value that is not finite")
    return out


def sample(policy: Policy, prompts: torch.Tensor, n: int = 1, temperature: float = 1.0,
           generator: torch.Generator | None = None, logprobs: list | None = None) -> torch.Tensor:
    """policy.sample, checked: (B*n, L) content-token ids (int64)."""
    seen = len(logprobs) if logprobs is not None else 0
    out = torch.as_tensor(policy.sample(prompts, n, temperature, generator, logprobs))
    expected = (len(prompts) * n, V.RESP_LEN)
    if out.shape != expected:
        raise InputError(f"{_name(policy)}: sample returned shape {tuple(out.shape)}, expected {expected}")
    if out.numel() and (out.dtype.is_floating_point or int(out.min()) < V.CONTENT_LO or int(out.max()) >= V.CONTENT_HI):
        raise InputError(f"{_name(policy)}: sample returned ids outside the content tokens "
                         f"[{V.CONTENT_LO}, {V.CONTENT_HI})")
    if logprobs is not None and len(logprobs) > seen:
        given = torch.cat([torch.as_tensor(x).reshape(-1) for x in logprobs[seen:]])
        logprobs[seen:] = [_rows(policy, "sample's logprobs", given, len(out))]
    return out.long()


def logprobs(policy: Policy, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """policy.logprobs, checked: (N,) sequence log-probabilities."""
    return _rows(policy, "logprobs", policy.logprobs(prompts, responses), len(responses))


def score(rm: RewardModel, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """rm.score, checked: (N,) scores."""
    return _rows(rm, "score", rm.score(prompts, responses), len(responses))


KINDS = {"policy": Policy, "reward model": RewardModel}


def load_impl(spec: str, location: str, kind: str, option: str) -> Policy | RewardModel:
    """The `kind` ('policy' or 'reward model') at `location` opened by the factory `spec` names
    ('package.module:factory'); InputError naming `option` when the spec, the import or the object fails."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InputError(f"{option} {spec!r}: expected an import path 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InputError(f"{option} {spec!r}: cannot import {module_name} ({e})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InputError(f"{option} {spec!r}: {module_name} has no callable {attr!r}")
    try:
        model = factory(location)
    except InputError:
        raise
    except Exception as e:  # another stack's loader: its failure in one line, naming the option
        raise InputError(f"{option} {spec!r}: {attr}({location!r}) failed: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(model, KINDS[kind]):
        wanted = "sample and logprobs" if kind == "policy" else "score"
        raise InputError(f"{option} {spec!r}: {attr}({location!r}) returned a {type(model).__name__}, not a {kind} "
                         f"(core/protocol.py: it needs {wanted})")
    return model
