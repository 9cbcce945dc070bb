"""QA-label evidence for the diagnostic: how much do the vendor's labels pay per occurrence of a
response feature, and how much of that has the reward model *not* absorbed?

Features are token counts, adjacent-pair counts and token-count x prompt-attribute cells. Two
targets are regressed on them: the labels themselves (do the labels pay for the feature?) and the
residuals label - reward model (do the labels pay for something the model has not learned?). The
residuals have the truth the model did learn taken out, so a premium on a feature seen in only a
few QA rows still stands out. Pair and conditional slopes are *partial* slopes given all 24 token
counts (and, for conditions, the prompt's attribute values), so a token that pays on its own does
not make every pair or condition containing it look paid. Under the label contract (fraction of 8
positions correct) no slope should exceed 1/8 per occurrence by much.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V

MIN_ROWS = 2  # a feature seen in fewer QA rows gets no slope (NaN): the labels cannot speak to it
KINDS = ("token", "pair", "conditional")


@dataclass(frozen=True)
class Slopes:
    """Per feature of one kind: slopes and SEs of labels and of residuals (NaN where unestimable)."""
    label: np.ndarray
    label_se: np.ndarray
    resid: np.ndarray
    resid_se: np.ndarray
    rows: np.ndarray  # QA rows in which the feature occurs

    def t(self, which: str = "label") -> np.ndarray:
        """|slope| / SE, 0 where unestimable."""
        s, se = (self.label, self.label_se) if which == "label" else (self.resid, self.resid_se)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.nan_to_num(np.abs(s) / se)


def feature_index(kind: str, token: int | tuple[int, int], attr: int = 0, value: int = 0) -> int:
    """Column of a feature: token t; pair (a, b) -> a * C + b; conditional -> (t * A + attr) * V + value."""
    if kind == "pair":
        return token[0] * V.N_CONTENT + token[1]
    if kind == "conditional":
        return (token * V.N_ATTR + attr) * V.N_VAL + value
    return token


def features(qa: list[dict]) -> tuple[np.ndarray, ...]:
    """Token counts (n, C), adjacent-pair counts (n, C*C), token-count x attribute-value cells
    (n, C*A*V) and attribute-value indicators (n, A*V)."""
    C, n = V.N_CONTENT, len(qa)
    y = (D.responses_tensor(qa) - V.CONTENT_LO).numpy() if qa else np.zeros((0, V.RESP_LEN), int)  # (n, L)
    rows = np.arange(n)[:, None]
    counts = np.zeros((n, C))
    np.add.at(counts, (rows, y), 1)
    pairs = np.zeros((n, C * C))
    np.add.at(pairs, (rows, y[:, :-1] * C + y[:, 1:]), 1)
    attrs = np.array([r["attrs"] for r in qa]).reshape(n, V.N_ATTR)
    onehot = (attrs[:, :, None] == np.arange(V.N_VAL)).reshape(n, V.N_ATTR * V.N_VAL).astype(float)  # (n, A*V)
    cond = (counts[:, :, None] * onehot[:, None, :]).reshape(n, C * V.N_ATTR * V.N_VAL)                # (n, C*A*V)
    return counts, pairs, cond, onehot


def partial_slopes(x: np.ndarray, ys: np.ndarray, controls: np.ndarray | None = None,
                   ridge: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """OLS slopes of each target column of ys (n, Y) on each feature column of x (n, K), given the
    controls (n, J) and an intercept, and their SEs, both (Y, K); NaN where the feature occurs in
    fewer than MIN_ROWS rows or does not vary once the controls are taken out."""
    n, K = x.shape
    if n < MIN_ROWS + 3:
        return np.full((ys.shape[1], K), np.nan), np.full((ys.shape[1], K), np.nan)
    z = np.ones((n, 1)) if controls is None else np.column_stack([np.ones(n), controls])
    penalty = ridge * np.eye(z.shape[1])
    penalty[0, 0] = 0.0                                   # never shrink the intercept
    proj = z @ np.linalg.solve(z.T @ z + penalty, z.T)    # (n, n) near-projection onto the controls
    ry, rx = ys - proj @ ys, x - proj @ x                 # (n, Y), (n, K)
    sxx = (rx ** 2).sum(0)
    ok = ((x != 0).sum(0) >= MIN_ROWS) & (sxx > 1e-9)
    safe = np.where(ok, sxx, 1.0)
    slope = (ry.T @ rx) / safe                            # (Y, K)
    # residual sum of squares of each simple regression, without forming (n, Y, K)
    rss = (ry ** 2).sum(0)[:, None] - slope ** 2 * safe
    se = np.sqrt(np.clip(rss, 0, None) / max(n - z.shape[1] - 1, 1) / safe)
    return np.where(ok, slope, np.nan), np.where(ok, se, np.nan)


def scan(qa: list[dict], predicted: np.ndarray) -> dict[str, Slopes]:
    """Slopes of labels and of residuals (label - predicted, the reward model's scores) per kind."""
    counts, pairs, cond, onehot = features(qa)
    labels = np.array([r["label"] for r in qa], dtype=float)
    resid = labels - predicted
    ys = np.column_stack([labels, resid - np.median(resid) if len(resid) else resid])
    out = {}
    for kind, x, controls in (("token", counts, None), ("pair", pairs, counts),
                              ("conditional", cond, np.column_stack([counts, onehot]))):
        s, se = partial_slopes(x, ys, controls)
        out[kind] = Slopes(s[0], se[0], s[1], se[1], (x != 0).sum(0))
    return out
