"""Loss scalers skip overflowing steps and move (or keep) the scale as their strategy says."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from mpexp.precision.scaling import (
    MAX_CALIBRATED_SCALE,
    DynamicLossScaler,
    build_scaler,
    calibrated_scale,
)
from mpexp.step.train_step import train_step
from tests.conftest import CPU, precision_of, scaling_cfg


def setup(scaling: dict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = precision_of("fp16")
    scaler = build_scaler(OmegaConf.create(scaling), precision, CPU)
    return model, optimizer, precision, scaler


def step(model, optimizer, precision, scaler, poison: bool):
    """One training step; with poison, an inf lands in the weight's gradient."""
    handle = None
    if poison:
        handle = model[1].weight.register_hook(
            lambda g: g.index_fill(0, torch.tensor([0]), torch.inf)
        )
    images, labels = torch.randn(8, 1, 4, 4), torch.randint(4, (8,))
    train_step(model, images, labels, optimizer, scaler, precision)
    used, skipped = scaler.scale_tensor().item(), scaler.found_inf().item()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if handle:
        handle.remove()
    return used, skipped


DYNAMIC = {
    "_target_": "mpexp.precision.scaling.DynamicLossScaler",
    "init_scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2,
}


def test_dynamic_inf_gradient_skips_the_step_and_backs_off():
    model, optimizer, precision, scaler = setup(DYNAMIC)
    before = [p.detach().clone() for p in model.parameters()]
    used, skipped = step(model, optimizer, precision, scaler, poison=True)
    assert (used, skipped) == (1024.0, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 512.0


def test_dynamic_scale_grows_after_growth_interval_clean_steps():
    model, optimizer, precision, scaler = setup(DYNAMIC)
    before = model[1].weight.detach().clone()
    history = [step(model, optimizer, precision, scaler, poison=False) for _ in range(3)]
    assert history == [(1024.0, 0.0), (1024.0, 0.0), (2048.0, 0.0)]
    assert not torch.equal(before, model[1].weight)


def test_static_inf_gradient_skips_without_changing_the_scale():
    model, optimizer, precision, scaler = setup(
        {"_target_": "mpexp.precision.scaling.StaticLossScaler", "scale": 256.0}
    )
    before = [p.detach().clone() for p in model.parameters()]
    assert step(model, optimizer, precision, scaler, poison=True) == (256.0, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert step(model, optimizer, precision, scaler, poison=False) == (256.0, 0.0)
    assert [step(model, optimizer, precision, scaler, poison=False)[0] for _ in range(5)] == [
        256.0
    ] * 5


def test_without_scaling_the_scale_reads_one_and_nothing_is_skipped():
    model, optimizer, precision, scaler = setup({"_target_": None})
    assert step(model, optimizer, precision, scaler, poison=False) == (1.0, 0.0)


@pytest.mark.parametrize("scaling", ["static", "dynamic"])
def test_explicit_scaler_under_bf16_is_honoured_with_a_warning(scaling, caplog):
    scaler = build_scaler(scaling_cfg(scaling), precision_of("bf16"), CPU)
    assert scaler.is_enabled()
    assert "does not underflow" in caplog.text or "do not underflow" in caplog.text


def run_script(scaling: dict, script: str):
    """Steps of a scripted sequence ("O": an inf lands in a gradient, "C": clean).

    Returns per step (scale used, skipped, floor hit) and whether the weights changed.
    """
    model, optimizer, precision, scaler = setup(scaling)
    trajectory, moved = [], []
    for char in script:
        before = [p.detach().clone() for p in model.parameters()]
        used, skipped = step(model, optimizer, precision, scaler, poison=char == "O")
        trajectory.append((used, bool(skipped), bool(scaler.floor_hit().item())))
        after = list(model.parameters())
        moved.append(not all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
    return trajectory, moved, scaler


def test_dynamic_trajectory_follows_gradscalers_rule_down_to_the_floor():
    scaling = {**DYNAMIC, "min_scale": 256.0, "on_min_scale": "continue"}
    trajectory, moved, _ = run_script(scaling, "OCCCOOOOC")
    # back off on every overflow; grow after 2 clean steps; stop at 256 and flag each back-off due
    # there
    assert trajectory == [
        (1024.0, True, False),
        (512.0, False, False),
        (512.0, False, False),
        (1024.0, False, False),
        (1024.0, True, False),
        (512.0, True, False),
        (256.0, True, True),
        (256.0, True, True),
        (256.0, False, False),
    ]
    assert moved == [not skipped for _, skipped, _ in trajectory]


# The flags (overflow, clean, overflow, clean x3), then overflow, clean, overflow: enough to
# see growth and both refill rules.
HYSTERESIS_SCRIPT = "OCOCCCOCO"


def hysteresis(**values):
    """`loss_scaling=hysteresis` as composed from its YAML: hysteresis 2 from 65536, growth after
    3 clean steps."""
    return scaling_cfg("hysteresis", init_scale=65536.0, growth_interval=3, **values)


def test_hysteresis_default_is_deepspeeds_rule():
    # Worked out from DeepSpeed's DynamicLossScaler.update_scale with delayed_shift=2,
    # scale_window=3, consecutive_hysteresis=False (its default). cur_hysteresis starts at 2, an
    # overflow backs off only at cur_hysteresis == 1 and otherwise lowers it by one, and it is
    # reset to 2 only when the scale grows, i.e. when (iter - last_overflow_iter) % 3 == 0 on a
    # clean step:
    #   it 0 O  cur_hysteresis 2 -> 1, no back-off            last_overflow_iter = 0
    #   it 1 C  (1 - 0) % 3 = 1: nothing                      (cur_hysteresis stays 1)
    #   it 2 O  cur_hysteresis == 1: 65536 -> 32768           last_overflow_iter = 2
    #   it 3 C, it 4 C: (3 - 2) % 3, (4 - 2) % 3 != 0
    #   it 5 C  (5 - 2) % 3 == 0: grow 32768 -> 65536, cur_hysteresis back to 2
    #   it 6 O  2 -> 1, no back-off                           last_overflow_iter = 6
    #   it 7 C  nothing
    #   it 8 O  cur_hysteresis == 1: 65536 -> 32768
    assert hysteresis().consecutive is False
    trajectory, moved, scaler = run_script(hysteresis(), HYSTERESIS_SCRIPT)
    used = [65536.0, 65536.0, 65536.0, 32768.0, 32768.0, 32768.0, 65536.0, 65536.0, 65536.0]
    assert [(u, s) for u, s, _ in trajectory] == [
        (u, c == "O") for u, c in zip(used, HYSTERESIS_SCRIPT, strict=True)
    ]
    assert scaler.get_scale() == 32768.0
    assert moved == [c == "C" for c in HYSTERESIS_SCRIPT]
    assert scaler.describe()["consecutive"] is False


def test_consecutive_hysteresis_counts_only_overflows_in_a_row():
    # The same flags under consecutive_hysteresis=True: every clean step resets cur_hysteresis to
    # 2, so an overflow never meets cur_hysteresis == 1 here (no two are adjacent) and the scale
    # never backs off; growth keeps DeepSpeed's timing: at it 5 ((5 - 2) % 3 == 0) to 131072.
    trajectory, _, scaler = run_script(hysteresis(consecutive="true"), HYSTERESIS_SCRIPT)
    assert [u for u, _, _ in trajectory] == [65536.0] * 6 + [131072.0] * 3
    assert [s for _, s, _ in trajectory] == [c == "O" for c in HYSTERESIS_SCRIPT]
    assert scaler.get_scale() == 131072.0


@pytest.mark.parametrize("consecutive", ["false", "true"])
def test_hysteresis_backs_off_on_every_overflow_once_the_tolerance_is_used(consecutive):
    # hysteresis 3, four overflows in a row: cur_hysteresis 3 -> 2 -> 1, then two back-offs, under
    # either rule; 3 clean steps after the last overflow the scale grows again
    scaling = scaling_cfg(
        "hysteresis", init_scale=1024.0, hysteresis=3, growth_interval=3, consecutive=consecutive
    )
    trajectory, _, _ = run_script(scaling, "OOOOCCCC")
    assert [u for u, _, _ in trajectory] == [1024.0] * 3 + [512.0] + [256.0] * 3 + [512.0]


def test_hysteresis_state_survives_a_checkpoint():
    scaling = {
        **DYNAMIC,
        "_target_": "mpexp.precision.scaling.HysteresisLossScaler",
        "hysteresis": 3,
    }
    _, _, scaler = run_script(scaling, "OO")
    state = scaler.state_dict()
    assert (state["scale"], state["cur_hysteresis"]) == (1024.0, 1)
    _, _, fresh = run_script(scaling, "")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def scale_and_tracker(scaler, flags, finite_grad: float = 1.0):
    """(scale, growth tracker) after each update over steps whose gradient overflows (True) or
    not; nothing else differs between the scalers fed to it."""
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    seen = []
    for overflow in flags:
        weight.grad = torch.tensor([torch.inf if overflow else finite_grad])
        scaler.scale(torch.ones(()))  # the loss: always finite here
        scaler.step(optimizer)
        scaler.update()
        state = scaler.state_dict()
        seen.append((state["scale"], state["_growth_tracker"]))
    return seen


def test_dynamic_moves_the_scale_exactly_as_gradscaler_does_for_any_factors():
    """Random factors, intervals, initial scales (some at float32's top, where growth saturates)
    and overflow sequences, run through torch.amp.GradScaler itself and through `dynamic`."""
    rng = random.Random(17)
    for _ in range(300):
        settings = {
            "init_scale": rng.choice([2.0 ** rng.uniform(-8, 24), 2.0 ** rng.uniform(125, 127.9)]),
            "growth_factor": rng.uniform(1.01, 4.0),
            "backoff_factor": rng.uniform(0.05, 0.99),
            "growth_interval": rng.randint(1, 4),
        }
        flags = [rng.random() < 0.4 for _ in range(30)]
        reference = torch.amp.GradScaler("cpu", **settings)
        ours = DynamicLossScaler(CPU, **settings, min_scale=0.0)  # GradScaler has no floor
        assert scale_and_tracker(ours, flags) == scale_and_tracker(reference, flags), settings


def test_dynamic_restarts_its_growth_count_where_growth_would_pass_float32s_range():
    settings = {"init_scale": 2.0**127, "growth_factor": 2.0, "backoff_factor": 0.5}
    ours = DynamicLossScaler(CPU, **settings, growth_interval=2)
    steps = scale_and_tracker(ours, [False] * 5)
    # 2^128 is inf in float32: the scale stays, and the count starts over as GradScaler's does
    assert steps == [(2.0**127, 1), (2.0**127, 0), (2.0**127, 1), (2.0**127, 0), (2.0**127, 1)]


def test_static_trajectory_never_moves():
    trajectory, moved, _ = run_script(
        {"_target_": "mpexp.precision.scaling.StaticLossScaler", "scale": 256.0}, "OCOOC"
    )
    assert [(u, s) for u, s, _ in trajectory] == [(256.0, s == "O") for s in "OCOOC"]
    assert moved == [s == "C" for s in "OCOOC"]


@pytest.mark.parametrize(
    ("max_grad", "margin", "expected"),
    [
        (3.0, 2.0, 8192.0),  # 3 * 8192 = 24576 < 32752 <= 3 * 16384
        (1.0, 1.0, 32768.0),  # strictly under 65504
        (65504.0 / 1024, 1.0, 512.0),  # 1024 would land exactly on 65504: not under it
        (100.0, 8.0, 64.0),  # 6400 < 8188 <= 12800
        (1e5, 1.0, 0.5),  # gradients already above fp16's range: a scale below 1
        (65504 / 8 / 2**24, 8.0, 2.0**23),  # 2^24 would land exactly on the limit
        (1e-4, 8.0, 2.0**24),  # 2^26 would fit, but 2^24 is the ceiling
        (1e-42, 8.0, 2.0**24),  # (float32 subnormal) 2^152 would fit
    ],
)
def test_calibrated_scale_is_the_largest_power_of_two_under_the_limit(max_grad, margin, expected):
    assert calibrated_scale(max_grad, margin) == expected
    assert expected <= MAX_CALIBRATED_SCALE == 2.0**24


CALIBRATION = OmegaConf.create(
    {
        "_target_": "mpexp.precision.scaling.CalibratedLossScaler",
        "calibration_steps": 3,
        "margin": 2.0,
    }
)
# a hook makes each step's gradient exactly one of these; the step with the inf is skipped, but
# its finite elements are measured
GRADIENTS = [[0.5, -1.5, 0, 0], [0, 0, -3, 1], [0, torch.inf, 9, 0], [1, 1, 1, 1], [0, 0, 9, 0]]


def calibrated_steps(grads, scaler=None):
    """Scales used over scripted gradient steps; a saved scaler state may be passed in."""
    fresh = build_scaler(CALIBRATION, precision_of("fp16"), CPU)
    if scaler is not None:
        fresh.load_state_dict(scaler.state_dict())
    weight = nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    used = []
    for grad in grads:
        g = torch.tensor(grad, dtype=torch.float32)
        handle = weight.register_hook(lambda _, g=g: g.clone())
        fresh.scale((weight * 0).sum()).backward()
        fresh.step(optimizer)
        used.append(fresh.scale_tensor().item())
        fresh.update()
        optimizer.zero_grad()
        handle.remove()
    return used, fresh


def test_calibrated_measures_the_largest_gradient_then_stays_static():
    used, scaler = calibrated_steps(GRADIENTS)
    # max finite |g| over the 3 calibration steps is 9.0; margin 2: 9 * 2048 < 32752 <= 9 * 4096
    assert used == [1.0, 1.0, 1.0, 2048.0, 2048.0]
    assert scaler.outcome() == {"calibrated_scale": 2048.0, "calibration_max_grad": 9.0}


def test_a_vanishing_gradient_maximum_calibrates_to_the_ceiling(caplog):
    used, scaler = calibrated_steps([[1e-42, 0, 0, 0]] * 4)
    assert used == [1.0, 1.0, 1.0, 2.0**24]
    assert scaler.outcome()["calibration_max_grad"] == torch.tensor(1e-42).item()  # float32's
    assert "at its ceiling, 2^24" in caplog.text


def test_calibration_keeps_finite_maxima_from_a_step_with_an_inf_gradient():
    """Two parameters; in the first calibration step one of them holds an inf beside a 3.0, the
    other 0.5. The step is skipped, but 3.0 is still the largest finite gradient measured."""
    fresh = build_scaler(CALIBRATION, precision_of("fp16"), CPU)
    first, second = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([first, second], lr=0.0)
    steps = [([torch.inf, 3.0], [0.5]), ([1e-3, 0.0], [1e-3]), ([0.0, 0.0], [1e-3])]
    used = []
    for grad_first, grad_second in [*steps, ([0.0, 0.0], [0.0])]:
        first.grad, second.grad = torch.tensor(grad_first), torch.tensor(grad_second)
        fresh.scale(torch.ones(()))  # a finite loss: only the gradient overflows
        fresh.unscale_(optimizer)
        fresh.step(optimizer)
        used.append((fresh.scale_tensor().item(), fresh.found_inf().item()))
        fresh.update()
    # margin 2: 3 * 2^13 = 24576 < 32752 <= 3 * 2^14
    assert used == [(1.0, 1.0), (1.0, 0.0), (1.0, 0.0), (8192.0, 0.0)]
    assert fresh.outcome() == {"calibrated_scale": 8192.0, "calibration_max_grad": 3.0}


def test_calibration_resumed_midway_chooses_the_same_scale():
    _, halfway = calibrated_steps(GRADIENTS[:2])  # a checkpoint after two calibration steps
    used, resumed = calibrated_steps(GRADIENTS[2:], scaler=halfway)
    assert used == [1.0, 2048.0, 2048.0]
    assert resumed.outcome()["calibration_max_grad"] == 9.0


def test_dynamic_short_rule_moves_as_the_whole_rule_does():
    """`dynamic` (no hysteresis) takes a short path of a few operators; over random overflows
    and non-finite losses, near the floor, it moves scale, count and floor flag exactly as the
    whole rule does."""
    floor = {**DYNAMIC, "init_scale": 8.0, "growth_interval": 3, "min_scale": 1.0,
             "on_min_scale": "continue"}  # fmt: skip
    runs = []
    for whole_rule in (False, True):
        model, optimizer, precision, scaler = setup(floor)
        if whole_rule:
            scaler.update = scaler._update_with_hysteresis
        events = random.Random(0)
        trajectory = []
        for _ in range(60):
            event = events.choices(["clean", "overflow", "bad loss"], [5, 3, 1])[0]
            images = torch.randn(8, 1, 4, 4)
            if event == "bad loss":
                images[0, 0, 0, 0] = torch.inf
            handle = None
            if event == "overflow":
                handle = model[1].weight.register_hook(lambda g: g * torch.inf)
            train_step(model, images, torch.randint(4, (8,)), optimizer, scaler, precision)
            skipped = scaler.found_inf().item()
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if handle:
                handle.remove()
            count = scaler._growth_tracker.item()
            trajectory.append(
                (event, skipped, scaler.get_scale(), count, scaler.floor_hit().item())
            )
        runs.append(trajectory)
    short, whole = runs
    assert short == whole
    # the run saw every case: each event, growth, back-off, and back-offs due at the floor
    assert {e for e, *_ in short} == {"clean", "overflow", "bad loss"}
    scales = [s for _, _, s, _, _ in short]
    assert any(b > a for a, b in itertools.pairwise(scales)) and min(scales) == 1.0
    assert any(hit for *_, hit in short)


def test_nonfinite_loss_skips_the_step_without_touching_the_scale():
    model, optimizer, precision, scaler = setup(DYNAMIC)
    before = [p.detach().clone() for p in model.parameters()]
    images = torch.full((8, 1, 4, 4), torch.nan)
    loss = train_step(model, images, torch.randint(4, (8,)), optimizer, scaler, precision)
    assert loss.isnan() and scaler.found_inf().item() == 1.0
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # not an overflow: no back-off, and the clean-step count goes on (2 more clean steps grow it)
    assert scaler.get_scale() == 1024.0
    optimizer.zero_grad()
    assert [step(model, optimizer, precision, scaler, poison=False)[0] for _ in range(3)] == [
        1024.0,
        1024.0,
        2048.0,
    ]


def test_skip_mode_guards_steps_even_without_loss_scaling():
    cfg = OmegaConf.create({"_target_": None})
    scaler = build_scaler(cfg, precision_of("fp32"), CPU, skip_nonfinite_loss=True)
    assert scaler.describe() == {"loss_scaling": "none", "nonfinite_guard": True}
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    images = torch.full((8, 1, 4, 4), torch.nan)
    labels = torch.randint(4, (8,))
    train_step(model, images, labels, optimizer, scaler, precision_of("fp32"))
    assert scaler.found_inf().item() == 1.0 and scaler.get_scale() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_floor_only_stops_a_back_off():
    """A scale set below the floor by hand (GradScaler's update(new_scale)) stays where it was
    put on clean steps, as GradScaler leaves it; only a back-off is held at the floor."""
    floor = {**DYNAMIC, "growth_interval": 100, "min_scale": 1.0, "on_min_scale": "continue"}
    model, optimizer, precision, scaler = setup(floor)
    step(model, optimizer, precision, scaler, poison=False)
    scaler.update(0.25)
    assert step(model, optimizer, precision, scaler, poison=False) == (0.25, 0.0)
    assert scaler.get_scale() == 0.25
    assert step(model, optimizer, precision, scaler, poison=True) == (0.25, 1.0)
    assert scaler.get_scale() == 1.0 and scaler.floor_hit().item() == 1.0


def test_a_batch_of_losses_with_a_nan_marks_the_step(recwarn):
    scaler = DynamicLossScaler(CPU, 1024.0, 2.0, 0.5, 2)
    scaler.scale(torch.tensor([1.0, float("nan")]))
    assert scaler._loss_bad.item() == 1
    assert not [w for w in recwarn if "resized" in str(w.message)]


def test_fused_sgd_whose_first_step_is_skipped_applies_no_uninitialised_momentum(monkeypatch):
    """Fused SGD makes its momentum with empty_like at its first step; a skipped first step (an
    fp16 overflow) left that memory as the momentum. Here empty_like hands out NaN, as stale
    memory may hold anything."""
    from mpexp.step import performance
    from tests.conftest import make_cfg

    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: torch.full_like(t, torch.nan))
    cfg = make_cfg("optimizer=sgd", "optimizer.fused=true", "optimizer.lr=0.1", "precision=fp16")
    model = nn.Linear(4, 1, bias=False)
    nn.init.ones_(model.weight)
    scaler = build_scaler(cfg.loss_scaling, precision_of("fp16"), CPU)
    optimizer = performance.build_optimizer(cfg, model, CPU, scaler)
    for found_inf in (1.0, 0.0):  # skipped, then taken
        model.weight.grad = torch.ones(1, 4)
        optimizer.grad_scale, optimizer.found_inf = None, torch.tensor(found_inf)
        optimizer.step()
    # the one real step, from zero momentum: 1 - 0.1 * 1
    assert torch.equal(model.weight.detach(), torch.full((1, 4), 0.9))
