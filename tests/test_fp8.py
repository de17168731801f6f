"""precision=fp8 on CPU, emulated: what it converts, what it rounds, what a run records and
reports, and what it refuses. The real fp8 path is in tests/test_gpu.py."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
import yaml
from torch import nn

from mpexp.build import build
from mpexp.errors import ConfigError
from mpexp.precision import fp8_support
from mpexp.precision.fp8 import check_fp8_rows, convert_to_fp8, linear_rows
from mpexp.precision.modes import setup_precision
from mpexp.precision.scaling import build_scaler
from mpexp.run.runner import train
from mpexp.step.diagnostics import fp8_count_keys, fp8_layer_counts
from mpexp.tracking.run_context import RunContext
from mpexp.validate import validate
from tests.conftest import (
    CONF,
    CPU,
    TINY,
    TINY_VIT,
    VIT_FP8_LAYERS,
    make_cfg,
    precision_of,
    run_cli,
)
from tests.test_report import read_table, sweep_dir
from tests.test_training import read_metrics
from tests.test_wandb import final_run, leet_records

CHANCE = 2.3026  # ln 10: the loss of a uniform guess over 10 classes


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    """The tiny ViT trained in fp8 with its range statistics every 8 steps, W&B offline."""
    run_dir = tmp_path_factory.mktemp("fp8_run")
    cfg = make_cfg(
        *TINY_VIT, "precision=fp8", "diagnostics.grad_stats_every=8", "wandb.mode=offline"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_SILENT", "true")
        summary = train(cfg, RunContext(run_dir))
    return run_dir, summary


def test_fp8_trains_the_vit_below_chance_loss(fp8_run):
    run_dir, summary = fp8_run
    _, epochs = read_metrics(run_dir)
    assert epochs[-1]["val/loss"] < CHANCE - 0.5
    assert summary["val/loss"] == epochs[-1]["val/loss"]


def test_what_ran_names_converted_and_unconverted_layers_in_summary_and_wandb(fp8_run):
    run_dir, _ = fp8_run
    ran = json.loads((run_dir / "summary.json").read_text())["ran"]
    assert (ran["precision"], ran["effective_precision"]) == ("fp8", "fp8")
    assert (ran["autocast_dtype"], ran["emulated"], ran["fp8_recipe"]) == (
        "bfloat16",
        True,
        "tensorwise",
    )
    assert ran["fp8_converted"] == VIT_FP8_LAYERS and ran["fp8_converted_count"] == 8
    assert ran["fp8_unconverted"] == {
        "heads.head": "64 inputs, 10 outputs: fp8 matrix multiplication needs multiples of 16"
    }
    assert ran["fp8_backend"].startswith("torchao ")
    assert ran["loss_scaling"] == "none"  # auto: torchao scales every fp8 tensor itself

    (wandb_dir,) = (run_dir / "wandb").glob("offline-run-*")
    in_wandb = final_run(leet_records(wandb_dir))["config"]["ran"]
    for key in ("fp8_recipe", "fp8_converted", "fp8_unconverted", "emulated"):
        assert in_wandb[key] == ran[key]


def test_fp8_range_statistics_cover_the_converted_layers_only(fp8_run):
    run_dir, _ = fp8_run
    steps, _ = read_metrics(run_dir)
    stats = [r for r in steps if "diag/total/weight_e4m3_underflow" in r]
    assert [r["step"] for r in stats] == [8, 16, 24, 32]
    layers = {k.removeprefix("diag/").rpartition("/")[0] for r in stats for k in r if "/" in k}
    assert layers == {*VIT_FP8_LAYERS, "total"}  # not the head; no fp16 statistics
    for row in stats:
        fractions = [v for k, v in row.items() if k.startswith("diag/")]
        assert len(fractions) == 9 * 8 and all(0 <= v <= 1 for v in fractions)
        # at torchao's amax scale the largest element lands on the format's largest value
        assert all(v == 0 for k, v in row.items() if k.endswith("_overflow"))


def test_the_fp8_vit_preset_is_vit_base_on_cifar10_shaped_data_and_converts_48_of_49_layers():
    """experiment=fp8_vit, built on the meta device (shapes, no memory or compute): every Linear
    layer of ViT-Base but the 10-class head has sizes fp8 can take, and they hold 99.99 % of
    the Linear weights."""
    cfg = make_cfg("experiment=fp8_vit")
    assert (cfg.model.width, cfg.model.depth, cfg.model.heads, cfg.model.mlp_ratio) == (
        768,
        12,
        12,
        4,
    )
    data = cfg.dataset
    assert (data.channels, data.height, data.width, data.train_size) == (3, 32, 32, 50000)
    assert cfg.trainer.compile is True and cfg.precision.fp8.recipe == "tensorwise"
    preset = yaml.safe_load((CONF / "experiment" / "fp8_vit.yaml").read_text())
    assert preset["hydra"]["sweeper"]["params"] == {
        "precision": "bf16,fp8",
        "trainer.seed": "0,1,2",
    }

    with torch.device("meta"):
        model = build(cfg.model, in_channels=3, num_classes=10, image_size=(32, 32))
    sizes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}
    assert sizes == {(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 10)}
    model, precision = convert_to_fp8(model, setup_precision(cfg.precision, CPU), [], True)
    record = precision.record()
    assert record["fp8_converted_count"] == 12 * 4
    assert record["fp8_unconverted"] == {
        "heads.head": "768 inputs, 10 outputs: fp8 matrix multiplication needs multiples of 16"
    }
    weights = {n: m.weight.numel() for n, m in model.named_modules() if hasattr(m, "in_features")}
    converted = sum(weights[n] for n in record["fp8_converted"])
    assert converted == 12 * (4 * 768 * 768 + 2 * 768 * 3072) == 84_934_656
    assert converted / sum(weights.values()) > 0.9999


def test_the_fp8_vit_presets_batches_put_a_multiple_of_16_token_rows_through_each_layer():
    """ViT-Base on 32x32 images: 64 patches and the class token, 65 rows per sample through
    every converted layer; the preset's 256 samples make 16,640, which fp8 on a GPU can take
    (and a batch of 200 would not)."""
    cfg = make_cfg("experiment=fp8_vit")
    with torch.device("meta"):
        model = build(cfg.model, in_channels=3, num_classes=10, image_size=(32, 32))
        rows = linear_rows(model, torch.zeros(1, 3, 32, 32))
    model, precision = convert_to_fp8(model, setup_precision(cfg.precision, CPU), [], True)
    assert {n: rows[n] for n in precision.fp8.converted} == {
        n: [65] for n in precision.fp8.converted
    }
    assert rows["heads.head"] == [1]  # the class token alone: left in bf16 all the same
    check_fp8_rows(precision, rows, cfg.dataset.batch_size, cfg.trainer.accumulate, last=0)
    with pytest.raises(ConfigError, match="13,000 per micro-batch"):
        check_fp8_rows(precision, rows, 200, 1, last=0)


def test_emulated_fp8_warns_once_that_the_numerics_are_real_and_the_speed_is_not(caplog):
    fp8_support._warned_fp8_emulated = False
    with caplog.at_level(logging.WARNING):
        first, second = precision_of("fp8"), precision_of("fp8")
    warnings = [r.getMessage() for r in caplog.records if "fp8" in r.getMessage()]
    assert len(warnings) == 1
    assert "emulated on CPU" in warnings[0] and "the numerics are real" in warnings[0]
    assert "the speed" in warnings[0] and "is not" in warnings[0]
    assert first.emulated and second.record()["emulated"] is True
    assert first.mode == first.effective == "fp8"


def test_a_converted_layer_rounds_its_operands_to_e4m3():
    """A Linear(16, 16) holding the identity: amax 448 gives the input the scale 1, so e4m3
    rounds it as it is, where bf16 would keep it."""
    x = torch.zeros(1, 16)
    x[0, :3] = torch.tensor([448.0, 1.0625, 1.0625 + 2.0**-12])
    outputs = {}
    for mode in ("bf16", "fp8"):
        layer = nn.Sequential(nn.Linear(16, 16, bias=False))
        with torch.no_grad():
            layer[0].weight.copy_(torch.eye(16))
        layer, precision = convert_to_fp8(layer, precision_of(mode), [], compiled=False)
        with precision.autocast():
            outputs[mode] = layer(x)[0, :3].float().tolist()
    assert outputs["bf16"] == [448.0, 1.0625, 1.0625]  # bf16 keeps 1.0625; 2^-12 above it not
    # e4m3 holds 1 and 1.125 here: 1.0625 is the tie between them, which goes to the even 1.0;
    # 1.0625 + 2^-12 is nearer 1.125, but passes through bf16 first, as on a GPU, and ties too
    assert outputs["fp8"] == [448.0, 1.0, 1.0]


class Mixed(nn.Module):
    """A Linear layer fp8 converts, and three it leaves alone, each for its own reason."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.attention = nn.MultiheadAttention(32, 2, batch_first=True)
        self.kept = nn.Sequential(nn.Linear(32, 32))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.body(x)
        x = self.attention(x, x, x, need_weights=False)[0]
        return self.head(self.kept(x))


def test_unconverted_layers_are_recorded_with_the_reason():
    model, precision = convert_to_fp8(Mixed(), precision_of("fp8"), ["kept"], compiled=False)
    record = precision.record()
    assert record["fp8_converted"] == ["body"]
    assert record["fp8_unconverted"] == {
        "attention.out_proj": "inside nn.MultiheadAttention, which uses the weight without "
        "calling the layer",
        "kept.0": "in precision.fp32_modules: runs in float32",
        "head": "32 inputs, 10 outputs: fp8 matrix multiplication needs multiples of 16",
    }
    assert type(model.body).__name__ == "Float8Linear" and type(model.head) is nn.Linear


def test_the_rowwise_recipe_reaches_torchao():
    cfg = make_cfg("precision=fp8", "precision.fp8.recipe=rowwise")
    model, precision = convert_to_fp8(
        nn.Sequential(nn.Linear(16, 16)), setup_precision(cfg.precision, CPU), [], compiled=False
    )
    assert precision.record()["fp8_recipe"] == "rowwise"
    assert model[0].config.cast_config_weight.scaling_granularity.value == "axiswise"
    assert model[0].config.cast_config_grad_output.target_dtype == torch.float8_e4m3fn


def test_a_recipe_given_to_another_mode_runs_fp8_and_says_so():
    # `precision.fp8` was a null node outside precision=fp8, and Hydra failed on the override
    # with an AssertionError traceback before any of mpexp ran
    cfg = make_cfg("precision=bf16", "precision.fp8.recipe=rowwise")
    record = setup_precision(cfg.precision, CPU).record()
    assert (record["precision"], record["fp8_recipe"]) == ("fp8", "rowwise")
    assert "fp8_recipe" not in precision_of("bf16").record()


def test_only_torchaos_recipes_compose():
    with pytest.raises(Exception, match=r"precision\.fp8\.recipe=blockwise") as err:
        make_cfg("precision=fp8", "precision.fp8.recipe=blockwise")
    assert "expected one of [tensorwise, rowwise, rowwise_with_gw_hp]" in str(err.value.__cause__)


def test_an_explicit_loss_scaler_under_fp8_is_honoured_with_a_warning(caplog):
    cfg = make_cfg("precision=fp8", "loss_scaling=dynamic")
    with caplog.at_level(logging.WARNING):
        scaler = build_scaler(cfg.loss_scaling, setup_precision(cfg.precision, CPU), CPU)
    assert scaler.is_enabled()
    assert "under precision=fp8" in caplog.text and "scaled per tensor by torchao" in caplog.text


def test_without_torchao_fp8_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # how Python marks a module as absent
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError) as err:
        precision_of("fp8")
    assert 'pip install "torchao>=0.18,<0.19"' in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["precision.autocast=float16"], "precision.fp8 needs precision.autocast=bfloat16"),
        (["model=simplecnn"], "precision=fp8 has nothing to convert"),
    ],
)
def test_fp8_that_cannot_take_effect_stops_before_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(make_cfg(*TINY, "precision=fp8", *overrides), RunContext(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dataset.batch_size=24"], "micro-batches of 24 samples .* 408 per micro-batch"
         ".* use dataset.batch_size=16 or 32"),
        (["trainer.accumulate=8"], "micro-batches of 8 samples .* trainer.accumulate=8\\)"
         ".* use dataset.batch_size=128, or trainer.accumulate=4"),
        (["dataset.train_size=1000", "dataset.drop_last=false"], "micro-batches of 40 samples"
         ".* use dataset.drop_last=true \\(the last batch holds 40 samples\\)"),
    ],
    ids=["batch", "accumulate", "last-batch"],
)  # fmt: skip
def test_fp8_refuses_micro_batches_whose_token_rows_are_not_a_multiple_of_16(
    tmp_path, overrides, message
):
    """The tiny ViT puts 17 rows (16 patches and the class token) per sample through its fp8
    layers; their weight gradients sum over a micro-batch's rows, which fp8 on a GPU takes only
    in multiples of 16. Refused before training, on a CPU too (whose emulation would run it)."""
    with pytest.raises(ConfigError, match=message) as err:
        train(make_cfg(*TINY_VIT, "precision=fp8", *overrides), RunContext(tmp_path))
    assert "17 rows per sample" in str(err.value) and "multiple of 16 samples" in str(err.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_fsdp_refuses_fp8_range_statistics(tmp_path):
    cfg = make_cfg(
        *TINY_VIT, "precision=fp8", "trainer.strategy=fsdp", "diagnostics.grad_stats_every=8"
    )
    with pytest.raises(ConfigError, match="fp8 range statistics need each weight's amax"):
        train(cfg, RunContext(tmp_path))


@pytest.mark.slow
def test_a_sweep_over_fp32_bf16_fp8_reports_three_configurations(tmp_path):
    vit = [o for o in TINY_VIT if not o.startswith(("trainer.epochs", "wandb"))]
    result = run_cli(
        "mpexp.train", "-m", "experiment=quickstart", *vit, "precision=fp32,bf16,fp8",
        "trainer.epochs=2", "dataset.train_size=256", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = sweep_dir(tmp_path)
    rows = read_table(sweep / "report.md", "Accuracy against fp32")
    assert [r["precision"] for r in rows] == ["fp32", "bf16", "fp8 (tensorwise, emulated)"]
    assert [r["parity"] for r in rows] == ["fp32 reference", *["inconclusive: single seed"] * 2]
    (fp8,) = read_table(sweep / "report.md", "fp8 against bf16")
    assert (fp8["configuration"], fp8["bf16 reference"]) == ("precision=fp8", "precision=bf16")
    assert fp8["converted layers"] == "8 of 9"
    assert (
        "Emulated fp8 (on a CPU) has fp8's numerics but not its speed"
        in (sweep / "report.md").read_text()
    )

    (report_dir,) = (sweep / "wandb-report" / "wandb").glob("offline-run-*")
    (table_file,) = report_dir.glob("files/media/table/report/table_*.table.json")
    table = json.loads(table_file.read_text())
    column = {name: table["columns"].index(name) for name in ("precision", "parity_vs_bf16")}
    assert [(r[column["precision"]], r[column["parity_vs_bf16"]]) for r in table["data"]] == [
        ("fp32", None),
        ("bf16", None),
        ("fp8", "single seed"),
    ]


def test_the_rowwise_with_gw_hp_recipe_keeps_the_weight_gradient_out_of_fp8():
    cfg = make_cfg("precision=fp8", "precision.fp8.recipe=rowwise_with_gw_hp")
    precision = setup_precision(cfg.precision, CPU)
    model, precision = convert_to_fp8(
        nn.Sequential(nn.Linear(16, 16)), precision, [], compiled=False
    )
    assert precision.record()["fp8_recipe"] == "rowwise_with_gw_hp"
    config = model[0].config
    assert config.cast_config_weight.scaling_granularity.value == "axiswise"
    # the weight gradient's product takes its operands in high precision
    assert config.cast_config_input_for_grad_weight.scaling_type.value == "disabled"
    assert config.cast_config_grad_output_for_grad_weight.scaling_type.value == "disabled"
    x = torch.randn(16, 16, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        model(x).sum().backward()
    assert torch.isfinite(model[0].weight.grad).all()
    # its range statistics count what it casts: the weight, by rows and whole
    keys = fp8_count_keys("rowwise_with_gw_hp")
    counts = fp8_layer_counts(model[0].weight, model[0].weight.grad, "rowwise_with_gw_hp")
    assert len(keys) == len(counts) and not any(k.startswith("grad") for k in keys)


def test_excluded_and_too_small_layers_stay_in_bf16_and_are_recorded():
    cfg = make_cfg("precision=fp8", "precision.fp8.exclude=[body.1]", "precision.fp8.min_size=64")
    model = nn.Sequential()
    model.add_module("body", nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
    model.add_module("neck", nn.Linear(64, 32))
    model, precision = convert_to_fp8(model, setup_precision(cfg.precision, CPU), [], False)
    record = precision.record()
    assert record["fp8_converted"] == ["body.0"]
    assert record["fp8_unconverted"] == {
        "body.1": "in precision.fp8.exclude: runs in bf16",
        "neck": "64 inputs, 32 outputs: below precision.fp8.min_size=64, too small for fp8 to pay",
    }
    assert (record["fp8_exclude"], record["fp8_min_size"]) == (["body.1"], 64)


def test_an_fp8_filter_that_cannot_take_effect_is_refused():
    with pytest.raises(ConfigError, match=r"precision\.fp8\.exclude .* no fp8"):
        validate(make_cfg("precision=bf16", "precision.fp8.exclude=[head]"))
    cfg = make_cfg("precision=fp8", "precision.fp8.exclude=[haed]")
    with pytest.raises(ConfigError, match="names haed, which Sequential does not have"):
        convert_to_fp8(
            nn.Sequential(nn.Linear(16, 16)), setup_precision(cfg.precision, CPU), [], False
        )
