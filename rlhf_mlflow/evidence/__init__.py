"""Gathering evidence: the layer that runs a policy and a reward model (any implementation of
core/protocol.py) to produce the arrays decisions/ decide from."""
