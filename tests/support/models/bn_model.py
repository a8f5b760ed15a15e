"""A user model factory with BatchNorm: its statistics come from each micro-batch, so an
accumulated step is not the big-batch step (what `rayacc verify` must catch)."""

from torch import nn


def build(dataset, hidden: int = 32) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dataset.num_features, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, dataset.num_classes),
    )
