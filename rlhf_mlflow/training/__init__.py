"""training: the RL loop and its two-process step, reward-model training, best-of-N, dev evaluation, recipes. Reports through callbacks."""
