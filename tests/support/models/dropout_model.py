"""A user model factory with dropout (`p`, 0 turns it off): what `rayacc verify` cannot turn
off by itself."""

from torch import nn


def build(dataset, hidden: int = 32, p: float = 0.1) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dataset.num_features, hidden),
        nn.ReLU(),
        nn.Dropout(p),
        nn.Linear(hidden, dataset.num_classes),
    )
