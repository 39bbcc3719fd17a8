"""Training: a small loop around the one TrainStep, with data, metrics and checkpoints."""
