"""Numerics instruments and the run-stopping guards, from constructed tensors to real runs."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from mpexp.errors import NumericsError
from mpexp.precision.fp8 import convert_to_fp8
from mpexp.precision.modes import setup_precision
from mpexp.precision.scaling import build_scaler
from mpexp.run.runner import train
from mpexp.step.diagnostics import (
    HIST_BINS,
    HIST_EDGES,
    HIST_LOW,
    Diagnostics,
    fp8_count_keys,
    fp8_counts,
    fp8_layer_counts,
    fp8_scale,
    fp16_counts,
)
from mpexp.tasks.classification import Classification
from mpexp.tracking.run_context import RunContext
from mpexp.tracking.tracker import Tracker
from tests.conftest import CPU, TINY, make_cfg, precision_of
from tests.test_training import read_metrics
from tests.test_wandb import history, leet_records

DIAG = OmegaConf.create({"grad_stats_every": 1, "overflow_attribution": True, "max_names": 2})

# Each value times the scale 16, cast to fp16:
GRAD = [
    0.0,  # zero already
    1e-20,  # 1.6e-19: far below fp16's smallest subnormal 2^-24, flushed to 0 -> underflow
    1e-9,  # 1.6e-8: below 2^-24 as well -> underflow
    2.0**-20,  # 2^-16: a subnormal (under 2^-14) -> underflow
    2.0**-10,  # 2^-6: normal
    -1.0,  # 16: normal
    100.0,  # 1600: normal
    -5000.0,  # 80000: above 65504 -> overflow
    1e5,  # 1.6e6 -> overflow
]


def test_underflow_and_overflow_fractions_are_exact():
    counts = fp16_counts(torch.tensor(GRAD), torch.tensor(16.0)).tolist()
    zero, underflow, overflow, hist = counts[0], counts[1], counts[2], counts[3:]
    assert (zero, underflow, overflow) == (1, 3, 2)
    # log2 of |16 g|, floored; beyond -40 and 16 the end bins collect
    expected = {-40: 1, -26: 1, -16: 1, -6: 1, 4: 1, 10: 1, 16: 2}
    assert {HIST_LOW + i: c for i, c in enumerate(hist) if c} == expected
    assert len(hist) == HIST_BINS == len(HIST_EDGES) - 1


# Values at fp16's edges (scale 1), each binned by what fp16 makes of it:
EDGES = [
    (65520.0, 16),  # rounds to inf: overflow, not the normal number it was
    (65519.0, 15),  # rounds down to 65504, fp16's largest: normal
    (2047.9, 11),  # rounds up to 2048
    (2.0**-14 - 2.0**-26, -14),  # rounds up to the smallest normal
    (1.5 * 2.0**-25, -24),  # rounds up to the smallest subnormal, 2^-24
    (2.0**-25, -25),  # rounds (to even) to zero: lost, binned by its own magnitude
    (2.0**-30, -30),  # lost
    (2.0**-26 * (1 - 2.0**-24), -27),  # lost, just below a power of two: binned below it
    (2.0**-35 * (1 - 2.0**-24), -36),
]


@pytest.mark.parametrize(("value", "expected_bin"), EDGES)
def test_histogram_bins_what_fp16_holds(value, expected_bin):
    counts = fp16_counts(torch.tensor([value]), torch.tensor(1.0)).tolist()
    hist = counts[3:]
    assert {HIST_LOW + i for i, c in enumerate(hist) if c} == {expected_bin}
    # the bin and the counts tell the same story
    assert counts[2] == (expected_bin == 16)  # overflow
    assert counts[1] == (expected_bin < -14)  # underflow: subnormal or lost


def test_per_layer_and_total_fractions_reach_the_metrics(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1, bias=False))  # 12 and 3 elements
    tracker = Tracker(
        RunContext(tmp_path), {}, OmegaConf.create({"mode": "disabled"}), Classification
    )
    scaler = build_scaler(
        OmegaConf.create({"_target_": "mpexp.precision.scaling.StaticLossScaler", "scale": 16.0}),
        precision_of("fp16"),
        CPU,
    )
    diagnostics = Diagnostics(DIAG, model, scaler, tracker)
    first, second = model
    first.weight.grad = torch.tensor(GRAD).reshape(3, 3)
    first.bias.grad = torch.tensor([1.0, 1.0, torch.inf])
    second.weight.grad = torch.tensor([[1e-9, 1.0, 1.0]])
    diagnostics.inspector(5)()
    diagnostics.after_update(5)
    diagnostics.flush(wait=True)
    tracker.close()

    steps, _ = read_metrics(tmp_path)
    (names,) = [r for r in steps if "diag/nonfinite_params" in r]
    assert names == {"step": 5, "diag/nonfinite_params": "0.bias", "diag/nonfinite_param_count": 1}
    (stats,) = [r for r in steps if "diag/total/underflow" in r]
    assert stats["step"] == 5
    assert (stats["diag/0/zero"], stats["diag/0/underflow"], stats["diag/0/overflow"]) == (
        1 / 12,
        3 / 12,
        3 / 12,  # the two from GRAD and the bias's inf
    )
    assert (stats["diag/1/underflow"], stats["diag/1/overflow"]) == (1 / 3, 0.0)
    assert (stats["diag/total/underflow"], stats["diag/total/overflow"]) == (4 / 15, 3 / 15)
    histogram = stats["diag/total/log2_hist"]
    assert histogram["edges"] == HIST_EDGES
    assert sum(histogram["counts"]) == 15 - 1 - 1  # minus the zero and the inf


def test_overflow_run_reports_diagnostics_to_wandb_and_local_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = make_cfg(
        *TINY,
        "precision=fp16",
        "loss_scaling=hysteresis",
        "loss_scaling.init_scale=67108864",  # 2^26, too high: the first steps overflow
        "diagnostics.grad_stats_every=4",
        "diagnostics.overflow_attribution=true",
        "scheduler=cosine",
        "wandb.mode=offline",
        "trainer.epochs=1",
    )
    summary = train(cfg, RunContext(tmp_path))
    steps, _ = read_metrics(tmp_path)
    per_step = [r for r in steps if "train/loss" in r]
    counts = [r["amp/skipped_steps"] for r in per_step]
    previous = [0, *counts[:-1]]
    skipped = [r["step"] for r, n, m in zip(per_step, previous, counts, strict=True) if m > n]
    opening = [r["step"] for r in per_step if r["amp/skipped_steps"] == r["step"]]
    assert opening[0] == 1 and summary["amp/skipped_steps"] == len(skipped)

    # every skipped step names the parameters that overflowed, and only those steps do
    key = "diag/nonfinite_params"
    attributed = {r["step"]: r[key] for r in steps if key in r}
    assert sorted(attributed) == skipped
    assert "conv1.weight" in attributed[1]

    stats = [r for r in steps if "diag/total/overflow" in r]
    assert [r["step"] for r in stats] == [4, 8, 12, 16]
    assert stats[0]["diag/total/overflow"] > 0  # step 4 still overflows at the scale it used
    # the cosine schedule moves only on real steps: the overflowing steps and the first real one
    # all run at the base rate
    assert {r["lr"] for r in per_step[: len(opening) + 1]} == {3e-3}
    assert per_step[-1]["lr"] < 3e-3

    (wandb_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = history(leet_records(wandb_dir))
    wandb_stats = [r for r in rows if "diag/total/overflow" in r]
    assert [r["diag/total/overflow"] for r in wandb_stats] == [
        r["diag/total/overflow"] for r in stats
    ]
    assert (
        wandb_stats[0]["diag/conv1/log2_hist.values"] == stats[0]["diag/conv1/log2_hist"]["counts"]
    )
    assert wandb_stats[0]["diag/conv1/log2_hist.bins"] == HIST_EDGES
    assert [r["diag/nonfinite_params"] for r in rows if "diag/nonfinite_params" in r] == list(
        attributed.values()
    )


def test_calibrated_run_trains_at_the_measured_scale_and_records_it(tmp_path, caplog):
    cfg = make_cfg(
        *TINY,
        "precision=fp16",
        "loss_scaling=calibrated",
        "loss_scaling.calibration_steps=5",
        "loss_scaling.margin=8",
        "trainer.epochs=1",
    )
    with caplog.at_level("INFO"):
        summary = train(cfg, RunContext(tmp_path))
    ran = summary["ran"]
    chosen, max_grad = ran["calibrated_scale"], ran["calibration_max_grad"]
    assert chosen == 2.0 ** round(torch.log2(torch.tensor(chosen)).item())
    assert max_grad * chosen < 65504 / 8 <= max_grad * chosen * 2
    steps, _ = read_metrics(tmp_path)
    assert [r["amp/scale"] for r in steps] == [1.0] * 5 + [chosen] * 11
    assert f"{chosen:g}" in caplog.text
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["ran"]["calibrated_scale"] == chosen


FLOOR = [
    "precision=fp16",
    "loss_scaling=dynamic",
    "loss_scaling.init_scale=1e30",  # every step overflows, and the floor is right here
    "loss_scaling.min_scale=1e30",
]


def test_the_min_scale_floor_stops_the_run_naming_step_cause_and_remedies(tmp_path):
    with pytest.raises(NumericsError) as err:
        train(make_cfg(*TINY, *FLOOR), RunContext(tmp_path))
    message = str(err.value)
    assert "floor at step 1" in message and "min_scale=1e+30" in message
    for remedy in ("optimizer.lr", "trainer.clip_grad_norm", "precision=bf16"):
        assert remedy in message
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_the_floor_can_be_ridden_out_with_continue(tmp_path):
    # every step overflows at the floor: `continue` trains on to the end, counting them; having
    # taken no optimizer step at all, the run then ends failed and says so
    with pytest.raises(NumericsError, match="all 16 steps were skipped"):
        train(
            make_cfg(*TINY, *FLOOR, "loss_scaling.on_min_scale=continue", "trainer.epochs=1"),
            RunContext(tmp_path),
        )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "No optimizer step was taken" in summary["error"]
    assert summary["amp/floor_hits"] == summary["amp/skipped_steps"] == 16
    assert summary["ran"]["final_scale"] == pytest.approx(1e30)


def test_floor_error_reaches_the_user_without_a_traceback(tmp_path, in_process):
    result = in_process("experiment=quickstart", *TINY, *FLOOR, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output
    assert "Loss scale hit its floor at step 1" in output


# fp16's forward pass overflows within two steps at this learning rate
DIVERGE = ["precision=fp16", "loss_scaling=none", "optimizer=sgd", "optimizer.lr=1e4"]


def test_nonfinite_loss_stops_the_run_with_step_and_last_finite_loss(tmp_path):
    with pytest.raises(NumericsError) as err:
        train(make_cfg(*TINY, *DIVERGE), RunContext(tmp_path))
    steps, _ = read_metrics(tmp_path)
    last = steps[-1]
    assert f"at step {last['step'] + 1}" in str(err.value)
    assert f"last finite loss was {last['train/loss']:.4g} at step {last['step']}" in str(err.value)


def test_nonfinite_loss_skip_counts_the_skipped_steps(tmp_path):
    summary = train(
        make_cfg(*TINY, *DIVERGE, "trainer.on_nonfinite_loss=skip", "trainer.epochs=1"),
        RunContext(tmp_path),
    )
    steps, epochs = read_metrics(tmp_path)
    nonfinite = [r["step"] for r in steps if r["train/loss"] != r["train/loss"]]
    assert nonfinite and summary["amp/nonfinite_loss_steps"] == len(nonfinite)
    assert [r["amp/nonfinite_loss_steps"] for r in steps][-1] == len(nonfinite)
    assert summary["ran"]["nonfinite_guard"] is True
    assert epochs[0]["train/epoch_loss"] == epochs[0]["train/epoch_loss"]  # finite steps only


# A weight whose amax is 448: torchao's scale is 1 for e4m3 (largest 448) and 128 for e5m2
# (largest 57344), both exact. e4m3 rounds |x| <= 2^-10 to zero (half its smallest subnormal
# 2^-9; the tie goes to the even zero); e5m2 rounds 128|x| <= 2^-17, i.e. |x| <= 2^-24.
FP8_WEIGHT = [
    0.0,  # zero already: neither
    448.0,  # the amax: e4m3's largest value exactly
    -1.0,
    2.0**-9,  # e4m3's smallest subnormal: held
    1.5 * 2.0**-10,  # rounds up to it: held
    2.0**-10,  # the tie: e4m3 underflow
    2.0**-12,  # e4m3 underflow
    2.0**-20,  # e4m3 underflow; 2^-13 in e5m2
    1.5 * 2.0**-24,  # e4m3 underflow; rounds up to e5m2's 2^-16
    2.0**-24,  # both: the tie in e5m2
    2.0**-30,  # both
]


def test_fp8_scales_are_torchaos_and_the_range_fractions_exact():
    from torchao.float8.float8_utils import tensor_to_scale

    w = torch.tensor(FP8_WEIGHT)
    assert fp8_scale(w, "e4m3").item() == 1.0 and fp8_scale(w, "e5m2").item() == 128.0
    # e4m3: 6 underflow; e5m2: 2; at the amax scale nothing overflows
    assert fp8_counts(w, fp8_scale(w, "e4m3"), "e4m3").tolist() == [6, 0]
    assert fp8_counts(w, fp8_scale(w, "e5m2"), "e5m2").tolist() == [2, 0]

    # the scale is torchao's own, bit for bit, over magnitudes spanning 2^-40 to 2^20
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.exp2(torch.randint(-40, 20, (4096,)).float())
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        scale = fp8_scale(x, fmt)
        assert torch.equal(scale, tensor_to_scale(x, dtype))
        # and the underflow count is what the cast to fp8 at that scale sets to zero
        lost = ((x * scale).to(dtype).float() == 0) & (x != 0)
        assert fp8_counts(x, scale, fmt)[0].item() == lost.sum().item() > 0


@pytest.mark.parametrize(
    ("fmt", "value", "overflows"),
    [
        ("e4m3", 463.0, False),  # rounds to 448, e4m3's largest
        ("e4m3", 464.0, True),  # halfway to the next step, 480, which e4m3 does not have
        ("e4m3", 1e6, True),
        ("e5m2", 61439.0, False),  # rounds to 57344
        ("e5m2", 61440.0, True),  # rounds to 65536: inf in e5m2
        ("e5m2", float("inf"), True),
        ("e5m2", float("nan"), True),
    ],
)
def test_fp8_overflow_is_rounding_past_the_largest_value(fmt, value, overflows):
    underflow, overflow = fp8_counts(torch.tensor([value]), torch.tensor(1.0), fmt).tolist()
    assert (underflow, overflow) == (0, int(overflows))


def fp8_range_row(tmp_path, recipe: str, weight: torch.Tensor, grad: torch.Tensor) -> dict:
    """The metrics row of the fp8 range statistics for a Linear(16, 16) converted under `recipe`
    and holding `weight` and `grad`, beside a 10-class head that fp8 leaves alone."""
    cfg = make_cfg("precision=fp8", f"precision.fp8.recipe={recipe}")
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 10))
    model, precision = convert_to_fp8(
        model, setup_precision(cfg.precision, CPU), [], compiled=False
    )
    tracker = Tracker(
        RunContext(tmp_path), {}, OmegaConf.create({"mode": "disabled"}), Classification
    )
    scaler = build_scaler(OmegaConf.create({"_target_": None}), precision, CPU)
    diagnostics = Diagnostics(DIAG, model, scaler, tracker, precision)
    with torch.no_grad():
        model[0].weight.copy_(weight)
    model[0].weight.grad = grad
    diagnostics.inspector(3)()
    diagnostics.flush(wait=True)
    tracker.close()
    steps, _ = read_metrics(tmp_path)
    (row,) = [r for r in steps if any(k.startswith("diag/total/") for k in r)]
    assert {k for k in row if k.startswith("diag/")} == {
        f"diag/{layer}/{key}" for layer in ("0", "total") for key in fp8_count_keys(recipe)
    }  # the head, 10 outputs, is not converted
    return row


def test_fp8_range_fractions_per_converted_layer_reach_the_metrics(tmp_path):
    weight = torch.zeros(16, 16)
    weight.view(-1)[: len(FP8_WEIGHT)] = torch.tensor(FP8_WEIGHT)
    # the gradient: the same spread, so the same fractions at its own scale
    row = fp8_range_row(tmp_path, "tensorwise", weight, weight / 2**10)
    for tensor in ("weight", "grad"):
        assert row[f"diag/0/{tensor}_e4m3_underflow"] == 6 / 256
        assert row[f"diag/0/{tensor}_e5m2_underflow"] == 2 / 256
        assert row[f"diag/0/{tensor}_e4m3_overflow"] == row[f"diag/0/{tensor}_e5m2_overflow"] == 0
    assert row["diag/total/weight_e4m3_underflow"] == 6 / 256


def torchao_weight_zeros(weight: torch.Tensor, recipe: str) -> tuple[int, int]:
    """How many non-zero elements of `weight` torchao's own casts round to zero under `recipe`:
    the forward pass's cast and the backward pass's (for the input's gradient), each made as
    torchao's Float8Linear makes it, from the transposed weight with the recipe's cast configs."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_scaling_utils import (
        get_maybe_axiswise_dim,
        hp_tensor_to_float8_dynamic,
    )
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    zeros = []
    # the axes torchao's matmul passes: 0 for the forward cast, -1 for the input-gradient one
    for cast, axis in (
        (config.cast_config_weight, 0),
        (config.cast_config_weight_for_grad_input, -1),
    ):
        fp8 = hp_tensor_to_float8_dynamic(
            weight.t(),
            cast.target_dtype,
            LinearMMConfig(),
            gemm_input_role=GemmInputRole.WEIGHT,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(axis, cast.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )
        zeros.append(int(((fp8._data.float() == 0) & (weight.t() != 0)).sum()))
    return zeros[0], zeros[1]


def one_loud_row(rows: int) -> torch.Tensor:
    """A (rows, 16) weight: its first row at 1e4, every other element at 1e-3."""
    weight = torch.full((rows, 16), 1e-3)
    weight[0] = 1e4
    return weight


def test_fp8_range_follows_the_recipe_as_torchao_casts():
    """The issue's 4x16 weight. One scale for the tensor (amax 1e4) puts 1e-3 at 4.5e-5, below
    e4m3's reach (2^-10): 48 of 64 elements lost. Rowwise, each quiet row gets its own scale
    (2^18: 1e-3 becomes 262) and none is lost in the forward cast; the backward's cast, one
    scale per column, has 1e4 in every column and loses the same 48."""
    weight = one_loud_row(4)
    tensorwise, rowwise = (
        dict(zip(fp8_count_keys(r), fp8_layer_counts(weight, weight, r).tolist(), strict=True))
        for r in ("tensorwise", "rowwise")
    )
    assert tensorwise["weight_e4m3_underflow"] == 48
    assert (rowwise["weight_rows_e4m3_underflow"], rowwise["weight_columns_e4m3_underflow"]) == (
        0,
        48,
    )
    assert not any(v for k, v in {**tensorwise, **rowwise}.items() if k.endswith("_overflow"))
    # what torchao's casts do to the same weight: forward cast, backward cast
    assert torchao_weight_zeros(weight, "tensorwise") == (48, 48)
    assert torchao_weight_zeros(weight, "rowwise") == (0, 48)


def test_fp8_rowwise_scales_are_torchaos_bit_for_bit():
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale

    torch.manual_seed(0)
    x = torch.randn(64, 48) * torch.exp2(torch.randint(-40, 20, (64, 48)).float())
    x[3] = 0  # an all-zero row: torchao's floor under amax gives it a finite scale
    for dim in (0, 1):
        ours = fp8_scale(x, "e4m3", dim, power_of_two=True)
        theirs = tensor_to_scale(
            x,
            torch.float8_e4m3fn,
            scaling_granularity=ScalingGranularity.AXISWISE,
            axiswise_dim=dim,
            round_scales_to_power_of_2=True,
        )
        assert torch.equal(ours, theirs) and torch.isfinite(ours).all()


def test_fp8_range_under_rowwise_reaches_the_metrics_per_row_and_column(tmp_path):
    weight = one_loud_row(16)
    row = fp8_range_row(tmp_path, "rowwise", weight, weight / 2**10)
    assert row["diag/0/weight_rows_e4m3_underflow"] == 0
    assert row["diag/0/weight_columns_e4m3_underflow"] == 240 / 256
    assert row["diag/0/grad_rows_e4m3_underflow"] == 0
    assert row["diag/total/weight_columns_e4m3_underflow"] == 240 / 256
