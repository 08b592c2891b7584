"""The Optuna tuner: search space, trial workers, studies and tuned tables."""
