"""The `main` step, one module per part: `run` (the whole story on one world, as a parent MLflow run with
a child run per step), `candidates` (training them side by side), `labels` (what main buys, when, and
its ledger), `rounds` (later rounds: repair the reward model with every label, retrain), `resume` (a
main that stopped continues), `summary` (the table), `view` (the experiment's front page)."""
