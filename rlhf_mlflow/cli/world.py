"""`rlhf-mlflow build-world`."""
from __future__ import annotations

import click

from rlhf_mlflow.cli.options import SEED, echo_json, overwrite_option


@click.command("build-world")
@click.option("--seed", type=SEED, default=0, show_default=True, help="World seed.")
@click.option("--spec", default="default", show_default=True,
              help="Corruption spec: 'default' (dune pa +1.45, ember he +0.47), 'clean', or a JSON file.")
@click.option("--scale", type=click.Choice(["full", "bench", "test"]), default="full", show_default=True,
              help="'test' builds a small world in seconds; 'bench' a mid-size one for benchmarks.")
@click.option("--out", default=None, help="Output directory (default: worlds/<hash>): new or empty, or a world this "
              "builder wrote (its manifest.json is its marker), reused when it is the one asked for.")
@overwrite_option("a different world this builder wrote")
def build_world_cmd(seed, spec, scale, out, overwrite):
    """Build (or reuse) a synthetic world with a hidden truth."""
    from rlhf_mlflow.steps.build_world import run_build_world
    from rlhf_mlflow.world import corruptions as C
    world, manifest = run_build_world(seed, C.load_spec(spec), scale, out, progress=click.echo,
                                       overwrite=overwrite)
    echo_json({"world": world.root, "world_hash": manifest["world_hash"], "timings": manifest["timings"]})


COMMANDS = (build_world_cmd,)
