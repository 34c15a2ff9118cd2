"""Models for the PyTorch benchmarks and examples; they need no torchvision.

``resnet_small``: a small ResNet on 32x32 images; ``convnet``: a plain conv net;
``mlp200``: an MLP with 200 parameter tensors, the worst case for per-tensor overhead.

Must not touch: Horovod itself (plain PyTorch models, shared by benchmarks and examples).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = torch.nn.BatchNorm2d(cout)
        self.c2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = torch.nn.BatchNorm2d(cout)
        self.skip = (
            torch.nn.Sequential()
            if stride == 1 and cin == cout
            else torch.nn.Sequential(
                torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.skip(x))


def resnet_small(num_classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, 1, 1, bias=False),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        Block(16, 16, 1),
        Block(16, 32, 2),
        Block(32, 64, 2),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(64, num_classes),
    )


def convnet(num_classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 128, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(128 * 4 * 4, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, num_classes),
    )


def mlp200(num_classes: int = 10) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 64)]
    for _ in range(98):
        layers += [torch.nn.ReLU(), torch.nn.Linear(64, 64)]
    layers += [torch.nn.ReLU(), torch.nn.Linear(64, num_classes)]
    return torch.nn.Sequential(*layers)  # 100 Linear layers = 200 parameter tensors


MODELS = {"resnet_small": resnet_small, "convnet": convnet, "mlp200": mlp200}
