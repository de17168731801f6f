"""The recipe people compare precisions on: top-5 accuracy, label smoothing, mixup and CutMix, an
fp32 moving average of the weights, zero-initialised residual branches, and
experiment=imagenet_resnet50 (torchvision's reference recipe for ResNet-50)."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from mpexp.build import with_objective
from mpexp.data.mixing import BatchMixing
from mpexp.errors import ConfigError
from mpexp.models.resnet import resnet18, resnet18_cifar, resnet50
from mpexp.run.runner import train
from mpexp.step.weight_average import WeightAverage
from mpexp.tasks.classification import Classification
from mpexp.tasks.language_model import LanguageModelling
from mpexp.tracking.run_context import RunContext
from mpexp.validate import validate
from tests.conftest import TINY, make_cfg
from tests.test_training import read_metrics

# --- top-5 accuracy ------------------------------------------------------------------------------


def test_top5_accuracy_is_the_share_of_items_whose_class_is_among_the_five_highest_logits():
    task = Classification(channels=1, height=2, width=2, num_classes=10)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 10, generator=generator)
    targets = torch.randint(0, 10, (64,), generator=generator)
    top1 = top5 = 0
    for row, target in zip(logits.tolist(), targets.tolist(), strict=True):  # by hand
        ranked = sorted(range(10), key=lambda c: -row[c])
        top1 += ranked[0] == target
        top5 += target in ranked[:5]
    metrics = task.val_metrics(task.val_sums(logits, targets).tolist(), 64)
    assert metrics["val/acc"] == top1 / 64 and metrics["val/acc5"] == top5 / 64
    assert 0 < top1 < top5 < 64  # the case tells the two apart


def test_padding_is_in_no_top5_and_fewer_than_five_classes_log_no_top5():
    task = Classification(channels=1, height=2, width=2, num_classes=10)
    logits = torch.randn(4, 10)
    padded = task.padded_targets(torch.tensor([1, 2]), 4)
    sums = task.val_sums(logits, padded).tolist()
    assert sums[2] <= 2
    few = Classification(channels=1, height=2, width=2, num_classes=3)
    sums = few.val_sums(logits[:, :3], torch.tensor([0, 1, 2, 0])).tolist()
    assert set(few.val_metrics(sums, 4)) == {"val/loss", "val/acc"}


def test_a_run_logs_top5_accuracy_each_epoch(tmp_path):
    train(make_cfg(*TINY, "trainer.epochs=1", "dataset.train_size=256"), RunContext(tmp_path))
    _, (epoch,) = read_metrics(tmp_path)
    assert epoch["val/acc"] <= epoch["val/acc5"] <= 1.0


# --- label smoothing ------------------------------------------------------------------------------


def test_label_smoothing_is_cross_entropys_own_and_leaves_validations_loss_plain():
    trainer = OmegaConf.create({"z_loss": 0.0, "label_smoothing": 0.1})
    task = with_objective(Classification(1, 2, 2, 10), trainer)
    logits, targets = torch.randn(8, 10), torch.randint(0, 10, (8,))
    smoothed = F.cross_entropy(logits, targets, label_smoothing=0.1)
    assert torch.equal(task.loss(logits, targets), smoothed)
    assert not torch.equal(smoothed, F.cross_entropy(logits, targets))
    plain = F.cross_entropy(logits, targets, reduction="sum")
    assert task.val_sums(logits, targets)[0] == pytest.approx(plain.item())


def test_label_smoothing_on_a_language_model_is_refused():
    trainer = OmegaConf.create({"z_loss": 0.0, "label_smoothing": 0.1})
    with pytest.raises(ConfigError, match=r"trainer\.label_smoothing=0\.1 applies to classifiers"):
        with_objective(LanguageModelling(vocab_size=8, block_size=4), trainer)


# --- mixup and CutMix -----------------------------------------------------------------------------


def one_hot(labels, classes=5):
    return F.one_hot(labels, classes).float()


def test_mixup_blends_each_image_and_its_target_with_the_batchs_previous_one():
    images, labels = torch.rand(6, 3, 8, 8), torch.tensor([0, 1, 2, 3, 4, 0])
    mixing = BatchMixing(5, mixup_alpha=0.2, cutmix_alpha=0.0, seed=0)
    before = images.clone()
    mixed, targets = mixing.mix(images, labels, random.Random(7))
    lam = random.Random(7).betavariate(0.2, 0.2)  # the same draw: mixup alone draws only lam
    partner = before.roll(1, 0)
    assert mixed is images  # in place: a static batch stays where a captured step reads it
    torch.testing.assert_close(mixed, lam * before + (1 - lam) * partner)
    torch.testing.assert_close(targets, lam * one_hot(labels) + (1 - lam) * one_hot(labels.roll(1)))
    torch.testing.assert_close(targets.sum(1), torch.ones(6))


def test_cutmix_pastes_a_box_of_the_previous_image_and_weighs_targets_by_its_area():
    images, labels = torch.rand(4, 3, 16, 12), torch.tensor([0, 1, 2, 3])
    before = images.clone()
    mixing = BatchMixing(5, mixup_alpha=0.0, cutmix_alpha=1.0, seed=0)
    mixed, targets = mixing.mix(images, labels, random.Random(3))
    pasted = (mixed != before).any(dim=(0, 1))  # the pixels that changed, in some image
    rows, cols = pasted.nonzero(as_tuple=True)
    top, bottom, left, right = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    assert pasted[top:bottom, left:right].all()  # one box
    box = (..., slice(top, bottom), slice(left, right))
    torch.testing.assert_close(mixed[box], before.roll(1, 0)[box])
    lam = 1 - (bottom - top) * (right - left) / (16 * 12)
    torch.testing.assert_close(
        targets, lam * one_hot(labels) + (1 - lam) * one_hot(labels.roll(1)), atol=1e-6, rtol=0
    )


class Given:
    """Draws decided in advance: the Beta draw, then each randrange's."""

    def __init__(self, lam: float, *picks: int):
        self.lam, self.picks = lam, list(picks)

    def betavariate(self, alpha: float, beta: float) -> float:
        return self.lam

    def randrange(self, stop: int) -> int:
        return self.picks.pop(0)


@pytest.mark.parametrize("kind", ["MixUp", "CutMix"])
def test_the_mixing_is_torchvisions_for_the_same_draws(kind):
    """torchvision.transforms.v2's MixUp and CutMix, their draws replayed from torch's
    generator, give the same images and targets."""
    from torchvision.transforms import v2

    images, labels = torch.rand(6, 3, 10, 14), torch.tensor([0, 1, 2, 3, 4, 1])
    alpha = 0.2 if kind == "MixUp" else 1.0
    torch.manual_seed(5)
    theirs = getattr(v2, kind)(alpha=alpha, num_classes=5)(images.clone(), labels)
    torch.manual_seed(5)  # the same draws, in their order: Beta, then the box's centre (x, y)
    lam = float(torch.distributions.Beta(torch.tensor([alpha]), torch.tensor([alpha])).sample(()))
    if kind == "MixUp":
        mixing, draws = BatchMixing(5, alpha, 0.0, seed=0), Given(lam)
    else:
        x, y = int(torch.randint(14, (1,))), int(torch.randint(10, (1,)))
        mixing, draws = BatchMixing(5, 0.0, alpha, seed=0), Given(lam, y, x)
    mine = mixing.mix(images.clone(), labels, draws)
    torch.testing.assert_close(mine[0], theirs[0])
    torch.testing.assert_close(mine[1], theirs[1])


def test_with_both_each_batch_takes_one_at_even_odds_and_a_resume_draws_the_same():
    mixing = BatchMixing(5, mixup_alpha=0.2, cutmix_alpha=1.0, seed=1)
    batches = [(torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])) for _ in range(200)]
    whole = list(mixing.batches(iter([(x.clone(), y) for x, y in batches]), epoch=2, start=0))
    # CutMix leaves most pixels as they were; mixup changes every one
    cut = sum(bool((x == b).any()) for (x, _), (b, _) in zip(whole, batches, strict=True))
    assert 70 < cut < 130
    resumed = list(mixing.batches(iter([(x.clone(), y) for x, y in batches[50:]]), 2, start=50))
    for (x, t), (rx, rt) in zip(whole[50:], resumed, strict=True):
        assert torch.equal(x, rx) and torch.equal(t, rt)


def test_mixing_a_language_models_batches_is_refused(tmp_path):
    from tests.test_language_model import tiny_lm

    cfg = make_cfg(*tiny_lm(tmp_path, "trainer.mixup_alpha=0.2", "trainer.epochs=1"))
    with pytest.raises(ConfigError, match=r"trainer\.mixup_alpha=0\.2 .* mix images"):
        train(cfg, RunContext(tmp_path / "run"))


# --- the weights' moving average ------------------------------------------------------------------


def steps_with_average(dtype: torch.dtype, steps: int = 6, every: int = 2, warmup: int = 0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = WeightAverage(model, decay=0.9, every=every, warmup_steps=warmup)
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    hand = [t.detach().float().clone() for t in tensors]
    updates = 0
    for step in range(1, steps + 1):
        model(torch.randn(8, 4, dtype=dtype)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        average.after_step(step)
        if step % every == 0:  # the same, by hand, in float32
            for h, t in zip(hand, tensors, strict=True):
                w = t.detach().float()
                h.copy_(w if updates == 0 or step <= warmup else 0.9 * h + 0.1 * w)
            updates += 1
    return model, average, hand


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_average_is_a_hand_rolled_float32_ema_whatever_the_weights_dtype(dtype):
    _, average, hand = steps_with_average(dtype)
    assert all(a.dtype == torch.float32 for a in average.average)
    for mine, theirs in zip(average.average, hand, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    # in bf16 the same average would have lost what rounding drops: it is not the weights
    assert not all(
        torch.equal(a, w.float()) for a, w in zip(average.average, average.sources, strict=True)
    )


def test_updates_through_the_warmup_copy_the_weights():
    _, average, _ = steps_with_average(torch.float32, steps=6, every=1, warmup=6)
    for mine, weights in zip(average.average, average.sources, strict=True):
        assert torch.equal(mine, weights)


def test_validation_sees_the_average_rounded_to_the_weights_and_then_the_weights_again():
    _, average, _ = steps_with_average(torch.bfloat16)
    weights = [t.clone() for t in average.sources]
    with average.swapped_in():
        for t, a in zip(average.sources, average.average, strict=True):
            assert t.dtype == torch.bfloat16 and torch.equal(t, a.to(torch.bfloat16))
    assert all(torch.equal(t, w) for t, w in zip(average.sources, weights, strict=True))


@pytest.mark.parametrize("precision", ["bf16", "bf16_pure"])
def test_a_run_validates_its_average_as_val_ema_and_a_resume_continues_it(tmp_path, precision):
    """With a decay of ~0 the average is the weights: val_ema equals val. The checkpoint keeps
    the average, so a resumed run validates the same one."""
    overrides = [*TINY, f"precision={precision}", "trainer.ema_decay=1e-9", "trainer.ema_every=1"]
    summary = train(make_cfg(*overrides), RunContext(tmp_path / "run"))
    _, epochs = read_metrics(tmp_path / "run")
    for epoch in epochs:
        assert epoch["val_ema/loss"] == pytest.approx(epoch["val/loss"], rel=1e-3)
        assert epoch["val_ema/acc"] == pytest.approx(epoch["val/acc"], abs=0.02)
    assert summary["val_ema/acc5"] >= summary["val_ema/acc"]


def test_a_slow_average_differs_from_the_weights_and_survives_a_resume(tmp_path):
    overrides = [*TINY, "trainer.ema_decay=0.99", "trainer.ema_every=1"]
    whole = train(make_cfg(*overrides), RunContext(tmp_path / "whole"))
    assert whole["val_ema/loss"] != pytest.approx(whole["val/loss"], rel=1e-3)
    train(make_cfg(*overrides, "trainer.epochs=1"), RunContext(tmp_path / "half"))
    resumed = train(
        make_cfg(*overrides, f"trainer.resume={tmp_path / 'half'}"), RunContext(tmp_path / "half")
    )
    assert resumed["val_ema/loss"] == pytest.approx(whole["val_ema/loss"], rel=1e-5)


def test_an_average_under_fsdp_is_refused():
    from mpexp.validate import validate

    with pytest.raises(ConfigError, match=r"trainer\.ema_decay under trainer\.strategy=fsdp"):
        validate(make_cfg(*TINY, "trainer.ema_decay=0.999", "trainer.strategy=fsdp"))


# --- zero_init_residual ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "block", "last"),
    [
        (resnet50, Bottleneck, "bn3"),
        (resnet18, BasicBlock, "bn2"),
        (resnet18_cifar, BasicBlock, "bn2"),
    ],
)
def test_zero_init_residual_zeroes_the_last_batchnorm_gamma_of_every_block(build, block, last):
    torch.manual_seed(0)
    model = build(num_classes=10, zero_init_residual=True)
    blocks = [m for m in model.modules() if isinstance(m, block)]
    assert blocks and all(not getattr(b, last).weight.any() for b in blocks)
    # nothing else: the other BatchNorms keep gamma 1
    others = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert sum(bool(bn.weight.any()) for bn in others) == len(others) - len(blocks)
    plain = build(num_classes=10)
    assert all(getattr(b, last).weight.all() for b in plain.modules() if isinstance(b, block))


def test_zero_init_residual_with_pretrained_weights_is_refused():
    with pytest.raises(ConfigError, match=r"model\.zero_init_residual=true"):
        resnet18(weights="IMAGENET1K_V1", zero_init_residual=True)


# --- the preset -----------------------------------------------------------------------------------


def test_the_imagenet_resnet50_preset_is_torchvisions_recipe_on_an_image_folder():
    cfg = make_cfg("experiment=imagenet_resnet50", "dataset.path=/data/imagenet")
    assert cfg.dataset._target_.endswith("ImageFolderData")
    assert cfg.model._target_.endswith("resnet50")
    t, opt = cfg.trainer, cfg.optimizer
    assert (t.label_smoothing, t.mixup_alpha, t.cutmix_alpha) == (0.1, 0.2, 1.0)
    assert (opt.lr, opt.momentum, opt.weight_decay) == (0.5, 0.9, 2e-5)
    assert not opt.decay_norms_and_biases and t.epochs == 600
    assert t.ema_every == 32 and t.ema_decay == pytest.approx(1 - 2e-5 * 8 * 128 * 32 / 600)
    assert cfg.scheduler._target_.endswith("cosine")
    # a run of max_steps has no epochs for the decay to follow: one message, the values to give
    short = make_cfg("experiment=imagenet_resnet50", "dataset.path=/data/imagenet",
                     "trainer.epochs=null", "trainer.max_steps=10")  # fmt: skip
    said = (
        r"trainer\.ema_decay cannot be worked out: .* trainer\.epochs=null\. Give trainer\.epochs"
    )
    with pytest.raises(ConfigError, match=said + r", or .*0\.9989077"):
        validate(short)


@pytest.mark.parametrize(
    ("overrides", "images"),
    [(["trainer.epochs=90"], 1024 * 32 / 90), (["dataset.batch_size=256"], 256 * 32 / 600)],
)
def test_the_presets_average_decay_follows_its_epochs_and_batch_as_torchvisions(overrides, images):
    # torchvision's train.py: alpha = (1 - model_ema_decay) x batch x model_ema_steps / epochs;
    # the preset held the value for 600 epochs of 1024, whatever the run changed
    cfg = make_cfg("experiment=imagenet_resnet50", "dataset.path=/data/imagenet", *overrides)
    assert cfg.trainer.ema_decay == pytest.approx(1 - 2e-5 * images)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "bf16_pure"])
def test_on_a_gpu_the_recipe_trains_with_its_step_captured(tmp_path, precision):
    """Mixed batches, smoothed labels and the average beside a captured step (pure bf16 runs
    eagerly: its update hooks are Python); the device clock finds a step fed from the device
    barely waiting; the step alone is timed after training."""
    overrides = [
        *TINY,
        "trainer.device=cuda",
        f"precision={precision}",
        "trainer.label_smoothing=0.1",
        "trainer.mixup_alpha=0.2",
        "trainer.cutmix_alpha=1.0",
        "trainer.ema_decay=0.99",
        "trainer.ema_every=2",
        "trainer.compute_only_steps=20",
    ]
    summary = train(make_cfg(*overrides), RunContext(tmp_path))
    assert summary["ran"]["cuda_graph"] is (precision == "bf16")
    _, epochs = read_metrics(tmp_path)
    for epoch in epochs:
        assert math.isfinite(epoch["val_ema/loss"]) and 0 <= epoch["val_ema/acc5"] <= 1
        assert epoch["perf/data_wait_share"] < 0.5  # the batches are gathered on the device
    assert summary["perf/compute_only_samples_per_s"] > 0
