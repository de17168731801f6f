from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from torchvision.models import ResNet18_Weights, ResNet50_Weights

from mpexp.build import build, build_model
from mpexp.errors import ConfigError
from mpexp.models.deepcnn import DeepCNN
from mpexp.models.vit import SelfAttention, vit
from mpexp.step import flops
from mpexp.tasks.classification import Classification
from tests.conftest import make_cfg


def test_deepcnn_has_the_tutorials_parameter_count():
    assert sum(p.numel() for p in DeepCNN(1, 10).parameters()) == 14_740_522


def test_deepcnn_is_fourteen_conv_bn_relu_blocks_then_three_linear_layers():
    model = DeepCNN(1, 10)
    assert len(model.features) == 14
    for block in model.features:
        conv, bn, relu = block
        assert isinstance(conv, nn.Conv2d) and conv.bias is not None
        assert isinstance(bn, nn.BatchNorm2d) and isinstance(relu, nn.ReLU)
    linears = [m for m in model.classifier if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [
        (1024, 1000),
        (1000, 1000),
        (1000, 10),
    ]


def test_vit_attention_computes_what_multihead_attention_computes():
    # the same weights in nn.MultiheadAttention and in the ViT's two Linear layers
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    attention = SelfAttention(64, 4)
    with torch.no_grad():
        attention.qkv.weight.copy_(mha.in_proj_weight)
        attention.qkv.bias.copy_(mha.in_proj_bias)
        attention.proj.weight.copy_(mha.out_proj.weight)
        attention.proj.bias.copy_(mha.out_proj.bias)
    x = torch.randn(3, 17, 64)
    expected, _ = mha(x, x, x, need_weights=False)
    got, weights = attention(x, x, x, need_weights=False)
    assert weights is None
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_vit_linear_layers_carry_most_of_its_flops():
    """What fp8 converts is where the work is: matrix products of Linear layers (addmm, mm)."""
    model = vit(in_channels=3, num_classes=10, image_size=(32, 32))
    # attention in matrix products the counter sees (it does not count CPU's fused kernel)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randn(2, 3, 32, 32)).sum().backward()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = sum(n for op, n in by_op.items() if op.split(".")[1] in ("addmm", "mm"))
    assert by_op["aten.bmm"] > 0  # attention's own products are counted
    assert linear / counter.get_total_flops() > 0.9
    layers = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(layers) == 6 * 4 + 1  # qkv, proj and the two MLP layers per block; the head
    assert layers[-1] == (192, 10)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dataset.height=28", "dataset.width=32"], "takes square images only, not 28x32"),
        (["model.patch_size=8"], "28 pixels are not a whole number of model.patch_size=8"),
        (["model.width=200"], "model.width=200 must be a multiple of model.heads=3"),
    ],
)
def test_vit_refuses_what_it_cannot_take_naming_the_key(overrides, message):
    cfg = make_cfg("dataset=synthetic", "model=vit", *overrides)
    info = build(cfg.dataset).setup(torch.device("cpu"))
    with pytest.raises(ConfigError, match=message):
        build_model(cfg.model, info, "vit")


def forward_macs(model: nn.Module, side: int) -> float:
    """Multiply-accumulates of one image's forward pass, by the count the run's FLOPs come from."""
    with flops._FlopCount() as counter:
        model.to("meta")(torch.empty(1, 3, side, side, device="meta"))
    return counter.total / 2


@pytest.mark.parametrize(("name", "published"), [("resnet18", ResNet18_Weights),
                                                  ("resnet50", ResNet50_Weights)])  # fmt: skip
def test_imagenet_resnets_at_224_have_torchvisions_published_flops(name, published):
    """torchvision publishes its models' forward GFLOPS as multiply-accumulates: ResNet-18 1.81."""
    task = Classification(channels=3, height=224, width=224, num_classes=1000)
    with torch.device("meta"):
        model = build(make_cfg(f"model={name}").model, **task.model_kwargs())
    assert forward_macs(model, 224) / 1e9 == pytest.approx(published.DEFAULT.meta["_ops"], rel=0.01)
    # what the run records: forward, loss and backward of one sample, about three forwards
    per_sample = flops.flops_per_sample(model, task, 2)
    assert 2.8 < per_sample / (2 * forward_macs(model, 224)) < 3.0


def test_the_cifar_resnet_keeps_small_images_whole_and_is_the_cifar_presets():
    with torch.device("meta"):
        cifar = build(make_cfg("model=resnet18_cifar").model, num_classes=10)
        imagenet = build(make_cfg("model=resnet18").model, num_classes=10)
    assert cifar.conv1.kernel_size == (3, 3) and isinstance(cifar.maxpool, nn.Identity)
    assert forward_macs(cifar, 32) == pytest.approx(0.556e9, rel=0.01)
    assert make_cfg("experiment=cifar10_resnet").model._target_.endswith("resnet18_cifar")
    # at 224 px the CIFAR stem costs about 15 ImageNet ResNet-18s: why resnet18 is ImageNet's
    assert 14 < forward_macs(cifar, 224) / forward_macs(imagenet, 224) < 16


def test_imagenet_resnets_take_one_channel_and_refuse_weights_they_cannot_use():
    with torch.device("meta"):
        grey = build(make_cfg("model=resnet18").model, in_channels=1, num_classes=10)
        assert grey(torch.randn(2, 1, 64, 64)).shape == (2, 10)
    with pytest.raises(ConfigError, match=r"model.weights=NEWEST names no weights of resnet18: "
                                          r"give one of IMAGENET1K_V1, DEFAULT"):  # fmt: skip
        build(make_cfg("model=resnet18", "model.weights=NEWEST").model, num_classes=10)
    with pytest.raises(ConfigError, match=r"model.weights=DEFAULT are for RGB images; this data "
                                          r"has 1 channel"):  # fmt: skip
        build(make_cfg("model=resnet18", "model.weights=DEFAULT").model, in_channels=1)


@pytest.mark.parametrize(("side", "patch", "tokens"), [(28, 4, 49), (32, 4, 64), (64, 8, 64),
                                                       (224, 16, 196)])  # fmt: skip
def test_vit_takes_its_patch_size_from_the_image_size(side, patch, tokens):
    with torch.device("meta"):
        model = build(make_cfg("model=vit").model, num_classes=10, image_size=(side, side))
    assert model.patch_size == patch and model.seq_length == tokens + 1  # and the class token


def test_vit_refuses_a_patch_size_that_makes_too_many_tokens_naming_the_keys():
    cfg = make_cfg("model=vit", "model.patch_size=4")
    with pytest.raises(ConfigError) as err:
        build(cfg.model, num_classes=10, image_size=(224, 224))
    assert str(err.value) == (
        "model.patch_size=4 cuts 224x224 images into 3,136 patches, more than "
        "model.max_tokens=1,024 (attention's cost grows with their square): give "
        "model.patch_size=null (16 here, 196 patches), or raise model.max_tokens."
    )
