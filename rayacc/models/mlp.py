from __future__ import annotations

from torch import nn


class MLP(nn.Module):
    """Feature vector → class logits. GELU hidden layers; no BatchNorm (its statistics would come
    from the micro-batch and break the equivalence with the big batch)."""

    def __init__(
        self, num_features: int, num_classes: int, hidden_sizes: list[int], dropout: float = 0.0
    ):
        super().__init__()
        layers: list[nn.Module] = []
        width = num_features
        for h in hidden_sizes:
            layers += [nn.Linear(width, h), nn.GELU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, features):
        return self.net(features)

    def flops_per_item(self, item_shape=None) -> float:
        """Training FLOPs per sample: forward + backward ≈ 6 × the matmul weights."""
        return 6.0 * sum(m.weight.numel() for m in self.net if isinstance(m, nn.Linear))
