"""A seed-faithful RL loop, kept only as the speed baseline (benchmarks/train_rl_speed.py).

It follows the seed's algorithm as the transcript shows it: the sampler re-runs the whole prefix for
each of the 8 tokens through the full-vocabulary forward (non-content logits masked to -1e9),
attention is torch's scaled_dot_product_attention, the policy's log-probs and entropy come from a
full-vocabulary log-softmax, the reference gets its own full forward, and prompts are drawn one at a
time in Python. Same maths as `rlhf_mlflow.train_rl`; none of its speed-ups.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.checkpoint import freeze


def _attn(attn, x, causal):
    B, T, Dm = x.shape
    q, k, v = attn.qkv(x).view(B, T, 3, attn.h, attn.dk).permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attn.out(a.transpose(1, 2).reshape(B, T, Dm))


def _trunk(model, ids, causal):
    B, T = ids.shape
    x = model.tok(ids) + model.pos(torch.arange(T))[None]
    for b in model.blocks:
        x = x + _attn(b.attn, b.ln1(x), causal)
        x = x + b.ff(b.ln2(x))
    return x


def policy_logits(policy, ids):
    logits = policy.head(policy.ln(_trunk(policy, ids, True)))
    out = torch.full_like(logits, -1e9)
    out[..., V.CONTENT_LO:V.CONTENT_HI] = logits[..., V.CONTENT_LO:V.CONTENT_HI]
    return out


@torch.no_grad()
def rm_score(rm, prompts_rep, responses, batch=2048):
    out = []
    for i in range(0, prompts_rep.shape[0], batch):
        ids = torch.cat([prompts_rep[i:i + batch], responses[i:i + batch]], 1)
        out.append(rm.head(rm.ln(_trunk(rm, ids, False)).mean(1)).squeeze(-1))
    return torch.cat(out)


@torch.no_grad()
def sample(policy, prompts, n, temperature, generator):
    ids = prompts.repeat_interleave(n, dim=0)
    L = policy.cfg["resp_len"]
    for _ in range(L):
        logits = policy_logits(policy, ids)[:, -1, :] / max(temperature, 1e-6)
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        ids = torch.cat([ids, nxt], 1)
    return ids[:, -L:]


def response_logprobs(policy, prompts_rep, responses, with_entropy=False):
    ids = torch.cat([prompts_rep, responses], 1)
    lp = torch.log_softmax(policy_logits(policy, ids)[:, prompts_rep.shape[1] - 1:-1, :], -1)
    tok = lp.gather(-1, responses[..., None]).squeeze(-1)
    if with_entropy:
        with torch.no_grad():
            ent = -(lp.exp() * lp).sum(-1).mean(-1)
        return tok, ent
    return tok


def sample_prompt_batch(by_fam, weights, B, rng):
    fams = list(weights)
    w = torch.tensor([weights[f] for f in fams], dtype=torch.float)
    out = []
    for _ in range(B):
        f = fams[int(torch.multinomial(w, 1, generator=rng))]
        pool = by_fam[f]
        out.append(pool[int(torch.randint(len(pool), (1,), generator=rng))])
    return out


def train(cfg, timings: dict | None = None):
    """cfg: a resolved RLConfig. Returns (policy, per-step history of mean proxy and KL)."""
    torch.manual_seed(cfg.seed)
    rng = torch.Generator().manual_seed(cfg.seed + 1)
    policy, _ = M.load_policy(cfg.policy_init or cfg.policy_ref)
    policy.train()
    ref = freeze(M.load_policy(cfg.policy_ref)[0])
    rm = freeze(R.load_rm(cfg.reward_model)[0])
    by_fam = D.group_by_family(D.read_jsonl(cfg.prompt_file))
    weights = cfg.family_weights or {f: 1.0 for f in by_fam}
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    G, B, beta = cfg.samples_per_prompt, cfg.batch_prompts, cfg.kl_coef
    history = []
    t = timings if timings is not None else {}
    for k in ("sample", "score", "backward"):
        t.setdefault(k, 0.0)
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        batch = sample_prompt_batch(by_fam, weights, B, rng)
        prompts = D.prompts_tensor(batch)
        prompts_rep = prompts.repeat_interleave(G, 0)
        policy.eval()
        resp = sample(policy, prompts, G, cfg.temperature, rng)
        policy.train()
        t1 = time.perf_counter()
        raw = rm_score(rm, prompts_rep, resp)
        lp, ent = response_logprobs(policy, prompts_rep, resp, with_entropy=True)
        with torch.no_grad():
            lp_ref = response_logprobs(ref, prompts_rep, resp)
        kl = (lp.detach() - lp_ref).sum(-1)
        shaped = raw - beta * kl
        adv = (shaped.view(B, G) - shaped.view(B, G).mean(1, keepdim=True)).view(-1)
        loss = -(adv * lp.sum(-1)).mean()
        t2 = time.perf_counter()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        opt.step()
        t3 = time.perf_counter()
        t["sample"] += t1 - t0
        t["score"] += t2 - t1
        t["backward"] += t3 - t2
        fam = [r["family"] for r in batch for _ in range(G)]
        history.append({"proxy": raw.tolist(), "kl": kl.tolist(), "family": fam})
    return policy, history
