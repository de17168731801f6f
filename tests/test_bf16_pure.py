"""Pure bf16 (precision=bf16_pure): bf16 weights, gradients and states, each update rounded as
`precision.update_rounding` says, and opt/updates_lost, the share of updates rounded away."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from mpexp.checkpoints import files
from mpexp.checkpoints.checkpoint import checkpoint_files
from mpexp.errors import ConfigError, ResumeRefused
from mpexp.models.simplecnn import SimpleCNN
from mpexp.precision.pure_optimizers import PureAdam, PureSGD
from mpexp.precision.pure_updates import CountUpdates, hold_in_bf16, round_stochastic
from mpexp.report import cli as report
from mpexp.run.runner import train
from mpexp.step.performance import build_optimizer, plan_speed
from mpexp.tracking.run_context import RunContext
from mpexp.validate import validate
from tests.conftest import CPU, TINY, make_cfg
from tests.test_report import read_table
from tests.test_resume import assert_same_final_state, comparable, crashed_and_resumed, status
from tests.test_training import read_metrics

# 8x8 images and a 4-channel SimpleCNN: bf16 is emulated on most CPUs, so the model stays tiny
PURE = [
    *(o for o in TINY if not o.startswith(("model.width", "dataset.train_size"))),
    "dataset.height=8",
    "dataset.width=8",
    "dataset.train_size=256",
    "dataset.batch_size=32",
    "model.width=4",
    "optimizer=adam",
    "precision=bf16_pure",
]


STATE_SECTION = "Training state against parity"


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared machine two threads per tiny op cost more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_tiny_cnn(rounding: str | None, steps: int = 100) -> tuple[float, float]:
    """A 4-channel SimpleCNN trained by Adam at lr 1e-4 (mpexp's default) on 512 random 8x8
    images labelled by a random linear teacher, in fp32 (`rounding` None) or pure bf16: the loss
    on all 512 images after `steps` steps, and the share of updates lost over them."""
    torch.manual_seed(0)
    images = torch.randn(512, 1, 8, 8)
    labels = (images.flatten(1) @ torch.randn(64, 10)).argmax(1)
    model = SimpleCNN(1, 10, (8, 8), width=4)
    if rounding is None:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        updates = CountUpdates(optimizer)
    else:
        hold_in_bf16(model)
        optimizer = PureAdam(model.parameters(), lr=1e-4, rounding=rounding, states=torch.float32)
        updates = optimizer
    order = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = torch.randint(0, 512, (32,), generator=order)
        F.cross_entropy(model(images[batch]), labels[batch]).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        loss = F.cross_entropy(model(images), labels).item()
    lost, moved = updates.lost.counts.sum(0).tolist()
    return loss, lost / moved


def test_nearest_rounds_updates_away_and_kahan_and_stochastic_keep_fp32s_result(one_thread):
    fp32, fp32_lost = train_tiny_cnn(None)
    results = {r: train_tiny_cnn(r) for r in ("nearest", "kahan", "stochastic")}

    assert fp32_lost == 0  # fp32 stores the optimizer's result as computed
    nearest, nearest_lost = results["nearest"]
    assert nearest_lost > 1 / 3
    gap = nearest - fp32
    assert gap > 2e-3  # clearly worse: the updates it lost never arrived (4.7e-3 measured)
    for rounding in ("kahan", "stochastic"):  # within noise: 1e-4 or less measured
        assert abs(results[rounding][0] - fp32) < gap / 10, rounding


def test_stochastic_rounding_is_the_value_in_expectation():
    x = torch.full((100_000,), 1 + 2**-9)  # a quarter of bf16's step (2^-7) above 1
    rounded = round_stochastic(x, torch.Generator().manual_seed(0)).float()

    assert set(rounded.unique().tolist()) == {1.0, 1 + 2**-7}  # the two neighbours only
    # up a quarter of the time: 0.25 within four standard deviations of 100,000 draws
    assert (rounded > 1).float().mean().item() == pytest.approx(0.25, abs=0.0055)
    assert torch.equal(rounded, round_stochastic(x, torch.Generator().manual_seed(0)).float())


def test_a_kahan_buffer_carries_updates_nearest_rounds_away():
    """A weight of 1 taking 64 updates of 2^-12 each, a sixteenth of its step: nearest keeps it
    at 1, Kahan summation arrives where fp32 would (1 + 2^-6, exactly in bf16)."""
    ends = {}
    for rounding in ("nearest", "kahan"):
        weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        optimizer = PureSGD([weight], lr=2**-12, rounding=rounding)
        for _ in range(64):
            weight.grad = torch.full_like(weight, -1.0)
            optimizer.step()
        ends[rounding] = weight.detach().float()
    assert torch.equal(ends["nearest"], torch.ones(4))
    assert torch.equal(ends["kahan"], torch.full((4,), 1 + 2**-6))


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("states", ["float32", "bfloat16"])
@pytest.mark.parametrize("fused", [False, True])
def test_weights_and_gradients_are_bf16_and_states_as_asked(optimizer, states, fused):
    cfg = make_cfg(*PURE, f"optimizer={optimizer}", f"precision.optimizer_states={states}")
    model = hold_in_bf16(SimpleCNN(1, 10, (8, 8), width=4))
    cfg.optimizer.fused = fused
    opt = build_optimizer(cfg, model, CPU, scaler=None)
    output = model(torch.randn(4, 1, 8, 8))
    assert output.dtype == torch.float32  # the loss is computed in fp32
    F.cross_entropy(output, torch.arange(4)).backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    opt.step()

    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    held = {v.dtype for s in opt.state.values() for v in s.values() if v.ndim}
    assert held == {getattr(torch, states)}
    assert bool(opt.defaults.get("fused")) == fused


def test_a_run_records_bf16_pure_and_logs_its_lost_updates(tmp_path, one_thread):
    summary = train(make_cfg(*PURE, "trainer.epochs=1"), RunContext(tmp_path))

    ran = summary["ran"]
    assert ran["precision"] == "bf16_pure"
    assert (ran["weights_dtype"], ran["update_rounding"], ran["optimizer_states"]) == (
        "bfloat16",
        "nearest",
        "bfloat16",
    )
    weights = sum(2 * p for p in (4 * 9 + 4, 8 * 4 * 9 + 8, 8 * 2 * 2 * 10 + 10))  # bf16: 2 bytes
    assert ran["bytes_weights"] == ran["bytes_grads"] == weights
    assert ran["bytes_states"] == 2 * weights  # Adam's two moments, in bf16
    steps, _ = read_metrics(tmp_path)
    lost = [r for r in steps if "opt/updates_lost" in r]
    assert [r["step"] for r in lost] == [4, 8]  # at trainer.log_every
    assert all(0 < r["opt/updates_lost"] <= 1 for r in lost)
    assert all(0 <= r["diag/conv1/updates_lost"] <= 1 for r in lost)
    final = files.load(checkpoint_files(tmp_path)[-1])
    assert {v.dtype for v in final["model"].values()} == {torch.bfloat16}


def test_updates_lost_is_zero_in_fp32_and_not_computed_unless_asked(tmp_path, one_thread):
    fp32 = [o for o in PURE if o != "precision=bf16_pure"]
    summary = train(make_cfg(*fp32, "trainer.epochs=1"), RunContext(tmp_path / "plain"))
    steps, _ = read_metrics(tmp_path / "plain")
    assert not any("opt/updates_lost" in r for r in steps)
    assert summary["ran"]["bytes_states"] == 2 * summary["ran"]["bytes_weights"]  # fp32 moments

    asked = [*fp32, "trainer.epochs=1", "diagnostics.updates_lost=true"]
    train(make_cfg(*asked), RunContext(tmp_path / "asked"))
    steps, _ = read_metrics(tmp_path / "asked")
    assert [r["opt/updates_lost"] for r in steps if "opt/updates_lost" in r] == [0.0, 0.0]


# the two roundings that keep state of their own (nearest keeps none: the plain resume tests cover
# its mechanism), each with one of the states' dtypes
@pytest.mark.parametrize(("rounding", "states"), [("kahan", "bfloat16"), ("stochastic", "float32")])
def test_each_rounding_resumes_exactly_after_a_crash(
    tmp_path, monkeypatch, caplog, rounding, states
):
    args = [
        *PURE,
        f"precision.update_rounding={rounding}",
        f"precision.optimizer_states={states}",
        "trainer.checkpoint_every_steps=3",
        "trainer.deterministic=true",
    ]
    whole, killed = crashed_and_resumed(args, tmp_path, monkeypatch, caplog)

    assert comparable(killed) == comparable(whole)
    assert status(killed) == "finished"
    # the Kahan buffers and the generator's state are in the optimizer's
    assert_same_final_state(whole, killed, ("model", "optimizer", "position"))
    optimizer = files.load(checkpoint_files(whole)[-1])["optimizer"]
    assert ("update_rounding_generator" in optimizer) == (rounding == "stochastic")
    kahan = [s for s in optimizer["state"].values() if "kahan_compensation" in s]
    assert bool(kahan) == (rounding == "kahan")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["precision=bf16", "precision.update_rounding=kahan"], "pure bf16 weights only"),
        (["precision=fp32", "+precision.optimizer_states=float32"], "pure bf16 weights only"),
        (["precision=bf16_pure", "loss_scaling=dynamic"], "bf16_pure with loss scaling"),
        (["precision=bf16_pure", "loss_scaling=static"], "bf16_pure with loss scaling"),
        (
            ["precision=bf16_pure", "optimizer._target_=torch.optim.Adagrad"],
            "cannot hold the states of optimizer torch.optim.Adagrad",
        ),
        (["precision=bf16_pure", "precision.autocast=bfloat16"], "nothing autocast"),
    ],
)
def test_bad_bf16_pure_settings_are_refused_before_anything_runs(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(make_cfg(*TINY, *overrides))
    assert "\n" not in str(err.value)


def test_a_checkpoint_of_fp32_weights_is_not_resumed_as_bf16_pure(tmp_path, one_thread):
    fp32 = [o for o in PURE if o != "precision=bf16_pure"]
    train(make_cfg(*fp32, "trainer.epochs=1"), RunContext(tmp_path))
    pure = make_cfg(*PURE, "trainer.epochs=2", f"trainer.resume={tmp_path}")

    with pytest.raises(ResumeRefused, match=r"written with float32 weights.*precision=bf16_pure"):
        train(pure, RunContext(tmp_path / "new"))
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "finished"


def test_the_report_puts_each_legs_bytes_beside_its_parity(tmp_path, one_thread):
    fp32 = [o for o in PURE if o != "precision=bf16_pure"]
    train(make_cfg(*fp32, "trainer.epochs=1"), RunContext(tmp_path / "fp32"))
    train(make_cfg(*PURE, "trainer.epochs=1"), RunContext(tmp_path / "pure"))
    assert report.main([str(tmp_path), "--no-plots"]) == 0

    rows = {r["configuration"]: r for r in read_table(tmp_path / "report.md", STATE_SECTION)}
    reference, pure = rows["fp32"], rows["pure"]
    # 666 parameters: 4 bytes each in fp32, 2 in bf16; Adam keeps two states per parameter
    assert (reference["weights"], reference["optimizer states"]) == ("2.6 KiB", "5.2 KiB")
    assert (pure["weights"], pure["gradients"], pure["optimizer states"]) == (
        "1.3 KiB",
        "1.3 KiB",
        "2.6 KiB",
    )
    assert (reference["vs fp32"], pure["vs fp32"]) == ("1.00x", "0.50x")
    # the step's peak: the held 5.2 KiB and the workspace, one batch of all 666 parameters
    # (704 elements: whole rows of 64) at 26 bytes an element (float32 weight, gradient, two
    # moments and the stored weight; the rounded bf16 weight; the compiled update's gathered
    # bf16 weight and gradient, a CPU's default), plus the count's sums and where the pieces
    # start; fp32's fused Adam (a CPU's default too) adds nothing to its 10.4 KiB
    assert (reference["step peak"], pure["step peak"]) == ("10.4 KiB", "30.3 KiB")
    assert pure["update rounding"] == "nearest, states bf16"
    assert reference["updates lost"] == "n/a" and 0 < float(pure["updates lost"]) <= 1
    assert pure["parity"] == "inconclusive: single seed"
    # the advice under the table: the share lost and the difference, and what to do about them
    text = (tmp_path / "report.md").read_text()
    advice = re.search(
        r"- pure: nearest lost (\d+)% of its updates and ended ([-+][\d.]+) points", text
    )
    assert advice is not None, text
    assert int(advice[1]) == round(100 * float(pure["updates lost"]))
    behind = float(advice[2]) < -0.5  # the classifier's tolerance: half a point of accuracy
    assert text[advice.end() :].startswith(
        " against fp32: use kahan or stochastic." if behind else " against fp32, within"
    )


def test_a_bf16_pure_step_is_captured_as_a_cuda_graph_unless_it_cannot_be(monkeypatch):
    """Decided from the config: no GPU needed. The fused update reads nothing on the host, so
    the step is captured like the other modes'; the op-by-op update reads its step count."""
    cuda = torch.device("cuda")
    assert plan_speed(make_cfg(*PURE), cuda).cuda_graph
    with pytest.raises(ConfigError, match=r"optimizer\.fused=false: an unfused step reads"):
        plan_speed(make_cfg(*PURE, "trainer.cuda_graph=true", "optimizer.fused=false"), cuda)
    stochastic = make_cfg(*PURE, "precision=bf16_pure_stochastic")
    assert plan_speed(stochastic, cuda).cuda_graph  # its generator is registered with the graph
    monkeypatch.setattr(torch.cuda, "CUDAGraph", type("CUDAGraph", (), {}))  # torch 2.4's lacks it
    assert "cannot register" in plan_speed(stochastic, cuda).graph_off
