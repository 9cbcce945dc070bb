"""rlhf_mlflow: a small, complete RLHF pipeline in pure PyTorch where every step is an MLflow run and
the model registry refuses to promote a policy that is not certified better on every prompt family.

The layers, each importing only those before it (docs/ARCHITECTURE.md): core, training, world,
decisions, tracking, steps, cli.
"""
