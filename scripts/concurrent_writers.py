"""Concurrent writers against one tracking store: does any metric point get lost?

    python scripts/concurrent_writers.py --tracking-uri http://127.0.0.1:5000 [--writers 4] [--steps 250]

Starts --writers processes at once. Each opens its own run and logs --steps steps of the per-family
metrics a train_rl run logs (`proxy/<family>`, `kl/<family>`, ... and `/balanced`), half through
the pipeline's buffered asynchronous MetricLogger (small batches) and half as synchronous
`log_metric` calls, then ends its run. Afterwards every metric history is read back. Prints one JSON
line: expected points, stored points, lost points, each writer's exit code and the seconds taken.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAMILIES = ["anvil", "birch", "cobalt", "dune", "ember", "fjord", "balanced"]
METRICS = ["proxy", "kl", "entropy"]


def keys() -> list[str]:
    return [f"{m}/{f}" for m in METRICS for f in FAMILIES]


def write(uri: str, experiment: str, writer: int, steps: int) -> None:
    """One writer process: a run, `steps` steps of every key, half async-batched, half synchronous."""
    import mlflow

    from rlhf_mlflow.tracking.metric_logger import MetricLogger
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=f"writer-{writer}", tags={"rlhf.step": "concurrency_check"}):
        logger = MetricLogger(flush_seconds=0.05)
        for step in range(1, steps + 1):
            values = {k: writer + step / 1000 for k in keys()}
            if step % 2:
                logger(step, values)
            else:
                for k, v in list(values.items())[:3]:  # a few synchronous calls, the rest as one batch
                    mlflow.log_metric(k, v, step=step)
                mlflow.log_metrics(dict(list(values.items())[3:]), step=step)
        logger.flush()


def count(uri: str, experiment: str) -> tuple[int, int]:
    """(runs, stored metric points) in the experiment."""
    import mlflow
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return 0, 0
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    return len(runs), sum(len(client.get_metric_history(r.info.run_id, k)) for r in runs for k in keys())


def run_check(uri: str, writers: int = 4, steps: int = 250, experiment: str | None = None) -> dict:
    import mlflow
    experiment = experiment or f"concurrency-{int(time.time() * 1000)}"
    # the store and the experiment exist before the writers start (on a brand-new sqlite file, writers
    # that start together also race to create its tables)
    if mlflow.MlflowClient(uri).get_experiment_by_name(experiment) is None:
        mlflow.MlflowClient(uri).create_experiment(experiment)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--tracking-uri", uri, "--experiment",
                               experiment, "--steps", str(steps), "--as-writer", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(writers)]
    outputs = [p.communicate()[0] for p in procs]
    seconds = time.perf_counter() - t0
    runs, stored = count(uri, experiment)
    expected = writers * steps * len(keys())
    errors = sorted({line.strip()[:200] for out in outputs for line in out.splitlines()
                     if "error" in line.lower() or "locked" in line.lower()})
    return {"tracking_uri": uri.split("@")[-1], "writers": writers, "runs": runs, "expected": expected,
            "stored": stored, "lost": expected - stored, "exit_codes": [p.returncode for p in procs],
            "seconds": round(seconds, 1), "errors": errors[:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--experiment", default=None)
    ap.add_argument("--as-writer", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.as_writer is not None:
        write(a.tracking_uri, a.experiment, a.as_writer, a.steps)
        return
    print(json.dumps(run_check(a.tracking_uri, a.writers, a.steps, a.experiment)))


if __name__ == "__main__":
    main()
