"""torchvision's ResNets: ImageNet's, for images of about 224 pixels, and ResNet-18 adapted to
28-32 px images (`resnet18_cifar`)."""

from __future__ import annotations

import logging

from torch import nn
from torchvision import models

from mpexp.errors import ConfigError, reason

log = logging.getLogger(__name__)

# below this many pixels the ImageNet stem (7x7 stride 2, then max-pool) leaves a few pixels for
# the residual stages: 32 px reach the first block as 8x8 and the last as 1x1
SMALLEST_IMAGENET_SIDE = 64


def resnet18(
    in_channels: int = 3,
    num_classes: int = 1000,
    image_size: tuple[int, int] = (224, 224),
    weights: str | None = None,
    zero_init_residual: bool = False,
) -> nn.Module:
    """torchvision's ResNet-18 as made for ImageNet (1.8 GMAC per 224 px image forward)."""
    _check_zero_init(zero_init_residual, weights)
    model = _imagenet_resnet("resnet18", in_channels, num_classes, image_size, weights)
    return _zero_residuals(model) if zero_init_residual else model


def resnet50(
    in_channels: int = 3,
    num_classes: int = 1000,
    image_size: tuple[int, int] = (224, 224),
    weights: str | None = None,
    zero_init_residual: bool = False,
) -> nn.Module:
    """torchvision's ResNet-50 as made for ImageNet (4.1 GMAC per 224 px image forward)."""
    _check_zero_init(zero_init_residual, weights)
    model = _imagenet_resnet("resnet50", in_channels, num_classes, image_size, weights)
    return _zero_residuals(model) if zero_init_residual else model


def resnet18_cifar(
    in_channels: int = 3,
    num_classes: int = 10,
    image_size: tuple[int, int] = (32, 32),
    zero_init_residual: bool = False,
) -> nn.Module:
    """ResNet-18 with a 3x3 stride-1 stem and no max-pool.

    The ImageNet stem (7x7 stride 2, then max-pool) would shrink a 28-32 px image to 7-8 px before
    the first residual stage; the usual CIFAR adaptation keeps the resolution. At 224 px this
    costs about 15 times ImageNet's ResNet-18: `resnet18` is the one for images that size.
    """
    model = models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    if zero_init_residual:
        _zero_residuals(model)
    # torchvision's forward keeps no Python-side state: the step may be captured as a CUDA graph
    # (mpexp.step.performance.declares_capturable)
    model.capturable = True
    return model


def _check_zero_init(zero_init_residual: bool, weights: str | None) -> None:
    if zero_init_residual and weights is not None:
        raise ConfigError(
            f"model.zero_init_residual=true initialises a ResNet trained from scratch; "
            f"model.weights={weights} brings trained gammas it would zero. Drop one of the two."
        )


def _zero_residuals(model: models.ResNet) -> models.ResNet:
    """Each residual branch's last BatchNorm with gamma 0, as torchvision's
    `zero_init_residual=True` gives: every block starts as the identity, which steadies the first
    steps at a large learning rate (Goyal et al., "Accurate, Large Minibatch SGD", 2017)."""
    for block in model.modules():
        if isinstance(block, models.resnet.Bottleneck):
            nn.init.zeros_(block.bn3.weight)
        elif isinstance(block, models.resnet.BasicBlock):
            nn.init.zeros_(block.bn2.weight)
    return model


def _imagenet_resnet(
    name: str,
    in_channels: int,
    num_classes: int,
    image_size: tuple[int, int],
    weights: str | None,
) -> nn.Module:
    """torchvision's `name`, with ImageNet weights where `weights` names them (a new head for
    `num_classes`), and a stem for `in_channels` where that is not 3."""
    if min(image_size) < SMALLEST_IMAGENET_SIDE:
        log.warning(
            "model=%s is ImageNet's %s: its stem and max-pool shrink %dx%d images to a quarter "
            "of their side before the first residual stage. model=resnet18_cifar is made for "
            "images this small.",
            name,
            name,
            *image_size,
        )
    if weights is None:
        model = getattr(models, name)(weights=None, num_classes=num_classes)
    else:
        model = _pretrained(name, weights, in_channels)
        if num_classes != model.fc.out_features:  # ImageNet's 1000 classes: a new head
            model.fc = nn.Linear(model.fc.in_features, num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.capturable = True  # as resnet18_cifar's: no Python-side state in the forward pass
    return model


def _pretrained(name: str, weights: str, in_channels: int) -> nn.Module:
    """torchvision's `name` with the weights `weights` names (downloaded once, into torch's hub
    folder); one message where they cannot be had."""
    key = f"model.weights={weights}"
    if in_channels != 3:
        raise ConfigError(
            f"{key} are for RGB images; this data has {in_channels} channel(s). Give "
            "model.weights=null to train from scratch."
        )
    known = models.get_model_weights(name)
    try:
        chosen = known.verify(weights)  # IMAGENET1K_V1, DEFAULT, or ResNet18_Weights.IMAGENET1K_V1
    except (KeyError, ValueError):
        names = ", ".join(known.__members__)
        raise ConfigError(f"{key} names no weights of {name}: give one of {names}.") from None
    try:
        return getattr(models, name)(weights=chosen)
    except (OSError, RuntimeError) as err:  # no network, a partial download, a full disk
        raise ConfigError(
            f"{key}: torchvision could not load {chosen} ({reason(err)}). Download them where "
            "the machine has a network (torch's hub folder, $TORCH_HOME), or give "
            "model.weights=null."
        ) from None
