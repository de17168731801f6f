from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mpexp.errors import ConfigError
from mpexp.models.deepcnn import DeepCNN
from mpexp.models.vit import SelfAttention, vit
from mpexp.run.build import build, build_model
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
