"""core: tokens, models, rollout, records, checkpoints, files, reward wrappers, shortcut rules, the world layout. torch and numpy only."""
