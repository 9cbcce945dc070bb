"""A synthetic world: a fixture directory in the seed's layout plus a hidden truth under `secret/`.

Only `world.oracle` reads `secret/`; nothing that makes a decision may import it.
"""
