"""Model factories that are wrong in each way a user's can be (tests of the pre-launch checks)."""

from torch import nn


def raises(dataset, **kwargs):
    raise ValueError("bad hidden size")


def no_dataset(width=4):
    return nn.Linear(width, 2)


def returns_int(dataset, **kwargs):
    return 3


def good(dataset, width=4):
    return nn.Linear(dataset.num_features, dataset.num_classes)


not_callable = 5
