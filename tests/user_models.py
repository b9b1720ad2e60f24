"""A user's own model module, as `--model user_models:small` names it (tests/ is importable in the
test processes and the ranks they spawn)."""

import torch
from torch import nn


class Small(nn.Module):
    """A CNN nobody here wrote: a depthwise convolution, batch norm, dropout in the head."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Conv2d(6, 6, 3, padding=1, groups=6, padding_mode="reflect"),
            nn.ReLU(),
        )
        self.head = nn.Sequential(
            nn.Dropout(0.2), nn.Linear(6 * 8 * 8, 30), nn.ReLU(), nn.Linear(30, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.body(x), 1))


def small(num_classes: int = 10) -> nn.Module:
    return Small(num_classes)


NOT_A_FUNCTION = 3


def returns_a_tensor() -> torch.Tensor:
    return torch.zeros(1)


def needs_arguments(width: int) -> nn.Module:
    return nn.Linear(width, 2)


def small_dense(num_classes: int = 3) -> nn.Module:
    """A dense predictor whose masks are half the image's size (a stride-2 stem)."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(4, num_classes, 1)
    )


def smoothed_loss():
    """--loss user_models:smoothed_loss: a torch loss module, as people pass one."""
    return nn.CrossEntropyLoss(label_smoothing=0.1)


def mean_loss():
    """--loss user_models:mean_loss: a function that returns a mean and takes no reduction."""
    return lambda out, y: nn.functional.cross_entropy(out, y)
