"""The small CNN from "How to Use Mixed Precision Training in PyTorch", sized to the input."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class SimpleCNN(nn.Module):
    """conv(width) -> pool -> conv(2*width) -> pool -> linear. The article's network is width=64
    on 32x32 colour images; here the linear layer follows the input's size and channels."""

    # its forward keeps no Python-side state: its step may be captured as a CUDA graph
    # (mpexp.step.performance.declares_capturable)
    capturable = True

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        image_size: tuple[int, int] = (32, 32),
        width: int = 64,
    ):
        super().__init__()
        height, wide = image_size
        if height < 4 or wide < 4:
            raise ValueError(
                f"it pools twice by 2, so images need 4x4 pixels at least, not {height}x{wide}"
            )
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width * (height // 4) * (wide // 4), num_classes)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return self.fc(x.flatten(1))
