"""torchvision's ResNet-18, adapted to small images."""

from __future__ import annotations

from torch import nn
from torchvision.models import resnet18 as torchvision_resnet18


def resnet18(
    in_channels: int = 3, num_classes: int = 10, image_size: tuple[int, int] = (32, 32)
) -> nn.Module:
    """ResNet-18 with a 3x3 stride-1 stem and no max-pool.

    The ImageNet stem (7x7 stride 2, then max-pool) would shrink a 28-32 px image to 7-8 px before
    the first residual stage; the usual CIFAR adaptation keeps the resolution.
    """
    model = torchvision_resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    # torchvision's forward keeps no Python-side state: the step may be captured as a CUDA graph
    # (mpexp.step.performance.declares_capturable)
    model.capturable = True
    return model
