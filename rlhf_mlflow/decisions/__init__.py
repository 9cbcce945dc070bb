"""decisions: the gold-free diagnostic, the correction, certification and the release guardrails. Pure functions of their inputs."""
