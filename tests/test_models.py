from __future__ import annotations

from torch import nn

from mpexp.models.deepcnn import DeepCNN


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
