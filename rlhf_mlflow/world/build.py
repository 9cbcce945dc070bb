"""Build a world: truth, reference policy, prompt pools, crowd and expert labels, reward model.

A world directory has the seed's fixture layout plus `secret/` (truth, corruption spec, the full
crowd batch) and `manifest.json`. Worlds are cached by the hash of what defines them (builder
version, seed, spec, scale), so asking again for the same world reuses it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError, read_json
from rlhf_mlflow.core.files import BUILD_WORLD, Owner, atomic_dir, atomic_write_json, atomic_write_text
from rlhf_mlflow.core.vocab import PILOT_MIX
from rlhf_mlflow.core.digest import digest_of, dir_files
from rlhf_mlflow.core.world_paths import WorldPaths, world_files
from rlhf_mlflow.training.rl_config import RLConfig
from rlhf_mlflow.training.train_rm import RMConfig, train_rm
from rlhf_mlflow.world import corruptions as C
from rlhf_mlflow.world.reference import (
    confusion_tables,
    demonstrations,
    demonstrator_distribution,
    train_sft,
)
from rlhf_mlflow.world.truth import Truth

log = logging.getLogger(__name__)
BUILDER_VERSION = "2"

@dataclass(frozen=True)
class WorldConfig:
    seed: int = 0
    """Seeds everything: truth, prompts, demonstrations, sampling, training."""
    shared_table: bool = True
    """Each family has one attribute-value -> token table and each position its own key attribute
    (False: a separate table per position, which the seed-sized reward model learns far less well)."""
    n_train: int = 1500
    """Training prompts per family (balanced pool)."""
    dev_mix: dict = field(default_factory=lambda: dict(PILOT_MIX))
    """Dev prompts per family: the pilot-traffic mix."""
    n_demo: int = 4000
    """SFT demonstrations per family."""
    demo_noise: float = 0.73
    """Probability that a demonstrated position is not the correct token."""
    demo_confusion: float = 0.8
    """Share of the wrong positions where the demonstrator answered for another attribute."""
    sft_epochs: int = 3
    sft_lr: float = 5e-3
    n_crowd: int = 2000
    """Crowd-labelled responses per family (reference at crowd_temperature)."""
    crowd_temperature: float = 1.2
    crowd_noise: float = 0.09
    """Std of the crowd's label noise, before corruptions."""
    n_qa: int = 200
    """Rows per family of the crowd batch shipped as the vendor's QA sample."""
    n_gold: int = 100
    """Expert-labelled reference responses per family (temperature 1.0)."""
    gold_noise: float = 0.03
    rm: RMConfig = RMConfig(epochs=16, batch_size=256, lr=2e-3, lr_schedule="cosine")
    """The vendor's reward-model recipe."""


SCALES = {
    "full": WorldConfig(),
    # many worlds for benchmarks: full prompt pools and QA sample, a smaller crowd batch and SFT set
    "bench": WorldConfig(n_demo=2000, n_crowd=1000, rm=RMConfig(epochs=12, batch_size=256, lr=2e-3,
                                                               lr_schedule="cosine")),
    # small enough for the test suite to build a world in seconds; same structure
    "test": WorldConfig(n_train=60, dev_mix={f: max(4, n // 20) for f, n in PILOT_MIX.items()}, n_demo=600,
                        sft_epochs=3, sft_lr=1e-2, n_crowd=150, n_qa=40, n_gold=30,
                        rm=RMConfig(epochs=4, batch_size=128, lr=2e-3)),
}


def world_hash(cfg: WorldConfig, spec: list[dict]) -> str:
    blob = json.dumps({"builder": BUILDER_VERSION, "config": asdict(cfg), "spec": spec}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _prompts(rng: np.random.Generator, counts: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    fam = np.concatenate([np.full(n, V.FAMILIES.index(f)) for f, n in counts.items()]).astype(np.int64)
    return fam, rng.integers(0, V.N_VAL, size=(len(fam), V.N_ATTR))


def _prompt_ids(fam: np.ndarray, attrs: np.ndarray) -> torch.Tensor:
    return torch.cat([torch.from_numpy(fam)[:, None] + V.FAM_ID[V.FAMILIES[0]],
                      torch.from_numpy(attrs) + V.VAL_ID[0],
                      torch.full((len(fam), 1), V.SEP)], 1).long()


def _records(prefix: str, fam, attrs, responses=None, labels=None, order=None) -> list[dict]:
    idx = range(len(fam)) if order is None else order
    out = []
    for k, i in enumerate(idx):
        r = {"id": f"{prefix}-{k:05d}", "family": V.FAMILIES[fam[i]], "attrs": [int(a) for a in attrs[i]]}
        if responses is not None:
            r["response"] = V.decode_response(responses[i])
            r["label"] = round(float(labels[i]), 4)
        out.append(r)
    return out


def build_world(out_dir: str, seed: int = 0, spec: list[dict] | None = None, scale: str = "full",
                progress: Callable[[str], None] | None = None, **overrides) -> dict:
    """Build a world into out_dir (written atomically); returns its manifest."""
    if scale not in SCALES:
        raise InputError(f"scale must be one of {sorted(SCALES)}, got {scale!r}")
    spec = C.validate_spec(C.DEFAULT_SPEC if spec is None else spec)
    cfg = replace(SCALES[scale], seed=seed, **overrides)
    say = progress or (lambda msg: log.info(msg))
    t0 = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    truth = Truth.generate(rng, cfg.shared_table)
    confusions = confusion_tables(rng)
    with atomic_dir(out_dir, Owner(BUILD_WORLD, world_hash(cfg, spec))) as tmp:  # its manifest is its marker
        world = WorldPaths(tmp)
        say("training the reference policy on noisy demonstrations")
        policy = _reference_policy(world, cfg, truth, confusions, rng, lambda epoch, n, loss: say(
            f"  reference epoch {epoch}/{n}: expected nll {loss:.3f} ({time.perf_counter() - t0:.0f} s)"))
        timings = {"sft_s": time.perf_counter() - t0}
        say("writing prompt pools")
        _prompt_pools(world, cfg, rng)
        say("annotating: crowd batch (with corruptions) and expert gold set")
        crowd = _annotate(world, cfg, spec, truth, policy, rng, gen)
        say(f"training the reward model on {len(crowd)} crowd labels ({cfg.rm.epochs} epochs)")
        t_rm = time.perf_counter()
        rm, info = train_rm(crowd, cfg.rm, on_log=lambda epoch, m: say(
            f"  reward model epoch {epoch}/{cfg.rm.epochs}: loss {m['loss']:.4f} ({time.perf_counter() - t0:.0f} s)"))
        timings["rm_s"] = time.perf_counter() - t_rm
        R.save_rm(rm, info["config"], world.reward_model)
        atomic_write_json(world.config, asdict(RLConfig()))
        atomic_write_text(os.path.join(tmp, "secret", "truth.json"),
                          json.dumps({"truth": truth.to_json(), "spec": spec, "confusions": confusions.tolist()}))
        timings["total_s"] = time.perf_counter() - t0
        manifest = {"world_hash": world_hash(cfg, spec), "builder_version": BUILDER_VERSION, "seed": cfg.seed,
                    "scale": scale, "spec": spec, "config": asdict(cfg), "timings": timings,
                    "files": dir_files(tmp), "world_sha256": digest_of(world_files(world))}
        atomic_write_json(world.path("manifest"), manifest)
    say(f"world {manifest['world_hash']} built in {timings['total_s']:.0f}s at {out_dir}")
    return manifest


def _reference_policy(world: WorldPaths, cfg: WorldConfig, truth: Truth, confusions: np.ndarray,
                      rng: np.random.Generator, on_epoch=None) -> M.Policy:
    """SFT on noisy demonstrations; saved as the world's policy/."""
    fam, attrs = _prompts(rng, {f: cfg.n_demo for f in V.FAMILIES})
    dist = demonstrator_distribution(truth, confusions, fam, attrs, cfg.demo_noise, cfg.demo_confusion)
    demo = torch.from_numpy(demonstrations(dist, rng)).long() + V.CONTENT_LO
    policy = train_sft(_prompt_ids(fam, attrs), demo, torch.from_numpy(dist), cfg.sft_epochs, cfg.sft_lr,
                       512, cfg.seed, on_epoch)
    M.save_policy(policy, M.default_config(), world.policy)
    return policy


def _prompt_pools(world: WorldPaths, cfg: WorldConfig, rng: np.random.Generator) -> None:
    fam, attrs = _prompts(rng, {f: cfg.n_train for f in V.FAMILIES})
    D.write_jsonl(world.prompts_train, _records("train", fam, attrs))
    fam, attrs = _prompts(rng, cfg.dev_mix)
    D.write_jsonl(world.prompts_dev, _records("dev", fam, attrs, order=rng.permutation(len(fam))))


def _annotate(world: WorldPaths, cfg: WorldConfig, spec: list[dict], truth: Truth, policy: M.Policy,
              rng: np.random.Generator, gen: torch.Generator) -> list[dict]:
    """The crowd batch (truth + noise + corruptions; the full batch secret, its QA sample shipped with
    the reward model) and the expert set (truth + small noise). Returns the crowd batch."""
    fam, attrs = _prompts(rng, {f: cfg.n_crowd for f in V.FAMILIES})
    prompts = _prompt_ids(fam, attrs)
    responses = rollout.sample(policy, prompts, 1, cfg.crowd_temperature, gen)
    labels = (truth.quality(prompts, responses) + cfg.crowd_noise * torch.randn(len(fam), generator=gen)
              + C.bonus(spec, prompts, responses))
    crowd = _records("ann", fam, attrs, responses, labels, order=rng.permutation(len(fam)))
    qa = [r for f in V.FAMILIES for r in [c for c in crowd if c["family"] == f][:cfg.n_qa]]
    rng.shuffle(qa)
    D.write_jsonl(os.path.join(world.root, "secret", "crowd_full.jsonl"), crowd)
    fam, attrs = _prompts(rng, {f: cfg.n_gold for f in V.FAMILIES})
    prompts = _prompt_ids(fam, attrs)
    responses = rollout.sample(policy, prompts, 1, 1.0, gen)
    labels = truth.quality(prompts, responses) + cfg.gold_noise * torch.randn(len(fam), generator=gen)
    D.write_jsonl(world.expert_set, _records("gold", fam, attrs, responses, labels, order=rng.permutation(len(fam))))
    D.write_jsonl(world.qa, qa)
    return crowd


def ensure_world(cache_dir: str, seed: int = 0, spec: list[dict] | None = None, scale: str = "full",
                 progress: Callable[[str], None] | None = None, **overrides) -> tuple[str, dict]:
    """The world for (seed, spec, scale, WorldConfig overrides) under cache_dir/<hash>, built once and
    reused after."""
    spec = C.validate_spec(C.DEFAULT_SPEC if spec is None else spec)
    h = world_hash(replace(SCALES[scale], seed=seed, **overrides), spec)
    path = os.path.abspath(os.path.join(cache_dir, h))
    manifest_path = os.path.join(path, "manifest.json")
    if os.path.isfile(manifest_path):
        return path, read_json(manifest_path)
    os.makedirs(cache_dir, exist_ok=True)
    (progress or log.info)(f"world {h} (seed {seed}, {scale}) not built yet: building it once")
    return path, build_world(path, seed, spec, scale, progress, **overrides)
