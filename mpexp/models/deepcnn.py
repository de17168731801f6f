"""The World4AI "Mixed Precision Training" tutorial's network, built exactly as printed there."""

from __future__ import annotations

from torch import nn

# (in_channels, out_channels, kernel, stride, padding) for each Conv-BN-ReLU block, in the
# tutorial's order. The first block's in_channels is replaced by the dataset's channel count.
BLOCKS = [
    (1, 32, 3, 1, 1),
    (32, 64, 3, 1, 1),
    (64, 64, 2, 2, 0),
    (64, 128, 3, 1, 1),
    (128, 128, 3, 1, 1),
    (128, 128, 3, 1, 1),
    (128, 128, 2, 2, 0),
    (128, 256, 3, 1, 1),
    (256, 256, 2, 1, 0),
    (256, 512, 3, 1, 1),
    (512, 512, 3, 1, 1),
    (512, 512, 3, 1, 1),
    (512, 512, 2, 2, 0),
    (512, 1024, 3, 1, 1),
]


def conv_block(c_in: int, c_out: int, kernel: int, stride: int, padding: int) -> nn.Sequential:
    """Conv2d (with bias, as in the tutorial) + BatchNorm2d + ReLU."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride, padding),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class DeepCNN(nn.Module):
    """14 conv blocks, global average pool, Linear 1024-1000-1000-classes. 14,740,522 parameters
    on MNIST. Far larger than MNIST needs, on purpose: it makes mixed precision's speed visible."""

    # its forward keeps no Python-side state: its step may be captured as a CUDA graph
    # (mpexp.step.performance.declares_capturable)
    capturable = True

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, image_size: tuple[int, int] = (28, 28)
    ):
        super().__init__()
        blocks = [(in_channels, *BLOCKS[0][1:]), *BLOCKS[1:]]
        self.features = nn.Sequential(*(conv_block(*b) for b in blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(BLOCKS[-1][1], 1000),
            nn.ReLU(),
            nn.Linear(1000, 1000),
            nn.ReLU(),
            nn.Linear(1000, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))
