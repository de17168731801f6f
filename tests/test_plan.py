"""mpexp-plan: every preset at its real size on fake tensors, bytes per parameter by precision,
the advice, and what it says of configs it cannot plan (against real runs:
test_plan_accuracy.py; what it counts beyond the step: test_plan_held.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mpexp import config
from mpexp.distributed import World
from mpexp.plan.__main__ import main as plan_main
from mpexp.plan.before_run import plan_run
from mpexp.plan.held import gib
from mpexp.plan.rows import Target, plan_rows
from mpexp.plan.table import table
from mpexp.report import cli as report
from tests.conftest import TINY, make_cfg, one_line_failure
from tests.test_config import FOLDER_PRESETS, TIMM_PRESETS
from tests.test_report import read_table

GiB = 2**30
CUDA = Target("cuda")
# experiment=finetune_lora fine-tunes a pretrained directory's model (model=hf model.pretrained=
# ...), which a plan needs given: its 8B-shaped LoRA row is planned in tests/test_lora_hf.py
PRESETS = sorted(
    p.stem for p in (config.config_dir() / "experiment").glob("*.yaml") if p.stem != "finetune_lora"
)
# the precisions a preset is planned in beyond those it sweeps: GPT-2 small's study's five
EXTRA = {"gpt2_small": ["fp32", "fp16", "fp8", "bf16_pure"]}
# the processes a preset's own comment runs it on (torchrun): each takes its share of the batch
PROCESSES = {"imagenet_resnet50": 8}


def swept_precisions(preset: str) -> list[str]:
    """The precisions a preset's sweep runs (its own where it sweeps none), and any in EXTRA."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config.config_dir()), version_base="1.3"):
        full = compose("train", [f"experiment={preset}"], return_hydra_config=True)
    swept = OmegaConf.select(full, "hydra.sweeper.params.precision")
    own = full.hydra.runtime.choices.precision
    return [*(str(swept).split(",") if swept else [own]), *EXTRA.get(preset, [])]


@pytest.fixture(scope="module")
def imagenet_classes(tmp_path_factory) -> Path:
    """An image folder's layout at ImageNet's size: 1,000 class folders (the plan only lists
    them)."""
    root = tmp_path_factory.mktemp("imagenet")
    for i in range(1000):
        (root / "train" / f"n{i:08d}").mkdir(parents=True)
    return root


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_plans_under_80_gib_in_each_precision_it_sweeps(preset, imagenet_classes):
    """At the sizes the preset ships (GPT-2 small's 480 windows of 1,024 tokens, ViT-Base's 256
    images, ResNet-50's 1,000 classes at 224 px), in every precision its sweep runs: the step's
    peak and validation's both fit an 80 GiB GPU. Two micro-batches reach the step's peak (see
    test_two_micro_batches_...)."""
    own = [f"experiment={preset}", f"precision={','.join(swept_precisions(preset))}"]
    # timm_precisions: its default model, convnext_tiny, whose peaks are above the ViT-S's it
    # also sweeps (7.1 against 4.4 GiB at batch 128 in bf16: docs/models.md)
    if preset in FOLDER_PRESETS or preset in TIMM_PRESETS:
        own.append(f"dataset.path={imagenet_classes}")
    n = PROCESSES.get(preset, 1)
    rows = plan_rows(own, Target("cuda", 80 * GiB, processes=n), preset_sweeps=False)
    assert rows
    for row in rows:
        peaks = row["peak_bytes"]
        assert not row["missing"], row["missing"]
        where = f"{row['overrides']}: step {peaks['train_step'] / GiB:.1f} GiB, " + (
            f"validation {peaks['validation'] / GiB:.1f} GiB; {row['advice']}"
        )
        assert row["fits"], where
    if preset == "gpt2_small":  # the preset's own step: 491,520 tokens in micro-batches of 12
        (bf16,) = [r for r in rows if r["precision"] == "bf16"]
        assert bf16["tokens_per_step"] == 491_520 and bf16["micro_batch"] == 12
        assert 120e6 < bf16["parameters"] < 130e6  # 124 M with the padded 50,304-token head
        # forward and backward: 6 FLOPs a parameter a token, and attention's on top
        assert 6 * bf16["parameters"] * 491_520 < bf16["flops_per_step"] < 1.5e15


@pytest.mark.parametrize(
    ("precision", "per_parameter"),
    [("fp32", 16), ("bf16", 16), ("fp16", 16), ("bf16_pure", 8), ("bf16_pure_kahan", 10)],
)
def test_bytes_held_per_parameter_under_adam_follow_the_arithmetic(precision, per_parameter):
    """Weights, gradients and Adam's two moments: fp32 4+4+8; mixed precision keeps fp32
    weights (4+4+8); pure bf16 2+2+2+2; Kahan's compensation 2 more."""
    (row,) = plan_rows([*TINY, f"precision={precision}", "optimizer=adam"], CUDA)
    b = row["bytes"]
    assert (b["weights"] + b["gradients"] + b["optimizer"]) / row["parameters"] == per_parameter
    assert b["compensation"] == (2 * row["parameters"] if "kahan" in precision else 0)


def test_two_micro_batches_reach_the_peak_of_all_of_them():
    overrides = [*TINY, "trainer.accumulate=8", "precision=fp16,bf16_pure_kahan"]
    every = plan_rows(overrides, Target("cuda", micro_batches=None))
    two = plan_rows(overrides, CUDA)
    for a, b in zip(every, two, strict=True):
        assert a["peak_bytes"]["train_step"] == b["peak_bytes"]["train_step"]
        assert a["bytes"] == b["bytes"]
        # validation's sums, added up across its micro-batches: a few bytes either way
        assert abs(a["peak_bytes"]["validation"] - b["peak_bytes"]["validation"]) < 1024
        assert a["flops_per_step"] == pytest.approx(b["flops_per_step"])


def test_a_comma_list_gives_a_row_per_value_written_as_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as ended:  # the last row does not fit in 1 MiB
        # a value listed twice plans once
        plan_main(
            [*TINY, "precision=fp32,bf16,fp32", "--device-memory", "1MiB", "--json", str(out)]
        )
    assert ended.value.code == 3
    rows = json.loads(out.read_text())["rows"]
    assert [r["precision"] for r in rows] == ["fp32", "bf16"]
    assert [r["overrides"][-1] for r in rows] == ["precision=fp32", "precision=bf16"]
    for row in rows:
        assert set(row["bytes"]) >= {"weights", "gradients", "optimizer"}
        assert set(row["peak_bytes"]) == {"train_step", "validation"}
        assert row["fits"] is False and row["flops_per_step"] > 0
        assert row["advice"], "a row that does not fit names the keys that would make it"
        assert row["largest"]["train_step"][0]["bytes"] > 0
    printed = capsys.readouterr().out
    assert "precision=fp32" in printed and "does not fit" in printed


def test_a_row_that_does_not_fit_is_told_keys_whose_own_plans_fit_at_the_peak_they_state():
    """The advice is planned again with its key set (it was estimated: GPT-2 small's said 6.6
    GiB, and its plan 6.95)."""
    wide = [*TINY, "model.width=64"]  # a wide CNN's activations: most of its peak
    (row,) = plan_rows(wide, CUDA)
    device = Target("cuda", int(row["need_bytes"] / 0.9 * 0.6))
    (small,) = plan_rows(wide, device)
    keys = [a.split()[0] for a in small["advice"]]
    assert {k.split("=")[0] for k in keys} == {"trainer.accumulate", "dataset.batch_size"}, keys
    for key, advice in zip(keys, small["advice"], strict=True):
        (fitted,) = plan_rows([*wide, key], device)
        assert fitted["fits"] and f"{gib(fitted['need_bytes'])} at the peak" in advice


def test_a_config_the_plan_cannot_build_gets_the_message_mpexp_train_gives(
    tmp_path, in_process, capsys, monkeypatch
):
    monkeypatch.setattr(sys, "argv", ["mpexp-plan"])  # as the installed command runs
    for mistake in (["precision=fp99"], ["trainer.accumulate=7"], ["trainer.acumulate=2"]):
        trained = one_line_failure(in_process(*TINY, *mistake, cwd=tmp_path))
        capsys.readouterr()
        with pytest.raises(SystemExit) as ended:  # the command's own entry point
            plan_main([*TINY, *mistake])
        printed = capsys.readouterr()
        said = (printed.out + printed.err).strip()
        assert ended.value.code in (1, 2) and "Traceback" not in said
        # the same lines, Hydra's advice on a mistyped key among them (but the hint at its
        # HYDRA_FULL_ERROR, which mpexp-plan does not read)
        hint = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."
        lines = [line for line in trained.splitlines() if line.strip() and line != hint]
        assert all(line in trained for line in said.splitlines()), (said, trained)
        assert all(line in said for line in lines), (said, trained)


def _users_models(folder: Path) -> None:
    (folder / "plan_users_models.py").write_text(
        "import torch\n"
        "from mpexp.models.simplecnn import SimpleCNN\n\n\n"
        "class Broken(SimpleCNN):\n"
        "    def forward(self, x):\n"
        "        raise RuntimeError('my model is broken')\n\n\n"
        "@torch.library.custom_op('plan_users::twice', mutates_args=())\n"
        "def twice(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x * 2\n\n\n"
        "class WithKernel(SimpleCNN):\n"
        "    def forward(self, x):\n"
        "        return super().forward(twice(x))\n"
    )


def test_a_users_model_that_raises_is_quoted_without_advice_on_the_images(
    tmp_path, in_process, monkeypatch
):
    _users_models(tmp_path)
    monkeypatch.syspath_prepend(tmp_path)
    model = "model._target_=plan_users_models.Broken"
    trained = one_line_failure(in_process(*TINY, model, cwd=tmp_path))
    for said in (trained, _planned_error([*TINY, model])):
        assert "my model is broken" in said, said
        assert "images' size" not in said and "dataset.height" not in said


def _planned_error(overrides: list[str]) -> str:
    from mpexp.errors import UserError

    with pytest.raises(UserError) as refused:
        plan_rows(overrides, CUDA)
    return str(refused.value)


def test_an_operator_fake_tensors_cannot_run_is_named_and_its_numbers_left_out(
    tmp_path, monkeypatch
):
    _users_models(tmp_path)
    monkeypatch.syspath_prepend(tmp_path)
    (row,) = plan_rows([*TINY, "model._target_=plan_users_models.WithKernel"], Target("cuda", GiB))
    assert row["peak_bytes"] == {"train_step": None, "validation": None}
    assert row["flops_per_step"] is None and row["fits"] is None
    # what it holds is not known either: no bytes a parameter from the weights alone
    assert row["bytes_per_parameter"] is None and " -  " in table([row]).splitlines()[2]
    assert "plan_users::twice" in row["missing"]["train_step"]
    assert row["bytes"]["weights"] > 0  # what it could follow, it gives


def test_presets_sweep_values_are_what_the_plan_expands():
    """The plan reads a preset's sweep as Hydra's -m would run it (seeds aside)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config.config_dir()), version_base="1.3"):
        full = compose("train", ["experiment=bf16_pure"], return_hydra_config=True)
    swept = OmegaConf.select(full, "hydra.sweeper.params.precision")
    assert swept.count(",") >= 2
    rows = plan_rows(["experiment=bf16_pure"], CUDA)
    assert [r["precision"] for r in rows] == swept.split(",")


def test_a_run_that_cannot_fit_is_refused_before_it_starts_with_its_plan(tmp_path, in_process):
    """A GPT whose weights alone outgrow this machine's memory, planned as a GPU run plans
    itself (trainer.plan=true on a CPU): refused before anything is built or written."""
    (tmp_path / "book.txt").write_text("some text to train on. " * 400)
    huge = [
        "model=gpt", "dataset=text", f"dataset.path={tmp_path / 'book.txt'}",
        f"dataset.cache_dir={tmp_path / 'cache'}", "model.n_layer=8", "model.n_embd=16384",
        "model.n_head=16", "trainer.plan=true", "wandb.mode=disabled",
    ]  # fmt: skip
    result = in_process(*huge, cwd=tmp_path)
    said = one_line_failure(result)
    assert "This run does not fit this machine's" in said, said
    assert "the weights, gradients and optimizer states hold" in said
    assert "precision=bf16_pure" in said  # the advice: fewer bytes a parameter
    assert result.returncode == 2 and not (tmp_path / "outputs").exists()


def test_a_planned_run_records_the_plan_beside_what_it_measured(tmp_path, in_process):
    run_dir = tmp_path / "run"
    result = in_process(*TINY, "trainer.epochs=1", "trainer.plan=true", f"hydra.run.dir={run_dir}",
                        cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    plan = summary["ran"]["plan"]
    assert plan["peak_bytes"]["train_step"] > plan["bytes"]["weights"] > 0
    assert summary["mem/planned_peak_mib"] == plan["need_bytes"] / 2**20
    assert plan["need_bytes"] == max(plan["peak_bytes"].values())  # no CUDA graph on a CPU
    report.main([str(run_dir), "--wandb", "disabled", "--no-plots"])
    (row,) = read_table(run_dir / "report.md", "Speed")
    assert row["planned peak (MiB)"] == f"{plan['need_bytes'] / 2**20:.1f}"  # the run's need

    # a resume of the same config takes the plan the run directory keeps (marked here, to be
    # told from one rehearsed again); another config is planned
    kept = json.loads((run_dir / "plan.json").read_text())
    kept["plan"]["seconds_per_step"] = "kept"
    (run_dir / "plan.json").write_text(json.dumps(kept))
    cpu = World(torch.device("cpu"))
    resumed = make_cfg(*TINY, "trainer.epochs=1", "trainer.plan=true", f"trainer.resume={run_dir}")
    assert plan_run(resumed, cpu, run_dir) == {**plan, "seconds_per_step": "kept"}
    other = plan_run(make_cfg(*TINY, "trainer.plan=true", "model.width=16"), cpu, run_dir)
    assert other["seconds_per_step"] is None  # no time estimated for a CPU
    assert other["bytes"]["weights"] > plan["bytes"]["weights"]


@pytest.mark.gpu
def test_a_gpu_runs_measured_peak_is_within_a_quarter_of_its_plan(tmp_path, in_process):
    """On a GPU every run plans itself: the allocator's measured peak against the plan's (the
    GPU issue's target is 10 % at GPT-2 small's size; a small GPT's peak has more fixed costs)."""
    (tmp_path / "book.txt").write_text("the quick brown fox jumps over the lazy dog. " * 4000)
    run_dir = tmp_path / "run"
    result = in_process(
        "model=gpt", "dataset=text", f"dataset.path={tmp_path / 'book.txt'}",
        f"dataset.cache_dir={tmp_path / 'cache'}", "model.n_layer=4", "model.n_embd=512",
        "model.n_head=8", "model.block_size=256", "dataset.batch_size=32", "precision=bf16",
        "trainer.epochs=1", "wandb.mode=disabled", "trainer.progress=false",
        f"hydra.run.dir={run_dir}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    # a captured step's pool is reserved, not allocated, during its replays: the plan's need is
    # held to the reserved peak there
    assert summary["mem/peak_reserved_mib"] >= summary["mem/peak_allocated_mib"] > 0
    assert abs(summary["mem/plan_error"]) < 0.25, summary["mem/plan_error"]


def test_the_planned_flops_agree_with_the_runs_own_count():
    """The plan's FLOPs per step (the rehearsal's products, attention's included on the CPU's
    fused kernel) and perf/tflops' count on the meta device (mpexp/step/flops.py) agree."""
    import torch

    from mpexp.models.gpt import GPT
    from mpexp.step.flops import flops_per_sample
    from mpexp.tasks.language_model import LanguageModelling

    sizes = {"n_layer": 2, "n_embd": 128, "n_head": 4, "block_size": 256}
    (row,) = plan_rows(["model=gpt", "dataset=text", "dataset.batch_size=8",
                        *[f"model.{k}={v}" for k, v in sizes.items()]], CUDA)  # fmt: skip
    with torch.device("meta"):
        model = GPT(vocab_size=256, **sizes)
    counted = flops_per_sample(model, LanguageModelling(256, 256), 8)
    assert row["flops_per_step"] / 8 == pytest.approx(counted, rel=0.05)


def test_under_torchrun_one_process_is_planned_with_its_share():
    """dataset.batch_size is the step's over all processes: 4 processes of 64 images take 16
    each; the plan is one process's and its FLOPs all of theirs."""
    (one,) = plan_rows([*TINY, "dataset.batch_size=16"], CUDA)
    (four,) = plan_rows([*TINY], Target("cuda", processes=4))
    assert four["micro_batch"] == one["micro_batch"] == 16 and four["processes"] == 4
    assert four["peak_bytes"] == one["peak_bytes"]
    assert four["flops_per_step"] == pytest.approx(4 * one["flops_per_step"])
    with pytest.raises(Exception, match=r"trainer\.accumulate=2 micro-batches cannot be shared"):
        plan_rows([*TINY, "trainer.accumulate=2"], Target("cuda", processes=4))


def test_the_largest_at_a_peak_include_what_its_op_read_and_freed_after():
    """A storage freed right after the op that made the peak was live at it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mpexp.plan.live_bytes import LiveBytes

    tracker = LiveBytes()
    with FakeTensorMode(), tracker:
        tracker.start("work")
        x = torch.empty(1000)
        y = x * 2  # the peak: x and y live, 8,000 bytes
        del x
    assert tracker.peaks["work"].nbytes == 8000
    assert sorted(t["bytes"] for t in tracker.largest_at("work")) == [4000, 4000]
    del y


def test_a_model_the_rehearsal_cannot_run_trains_unplanned_with_a_warning(
    tmp_path, in_process, monkeypatch
):
    (tmp_path / "plan_host_models.py").write_text(
        "from mpexp.models.simplecnn import SimpleCNN\n\n\n"
        "class ReadsValues(SimpleCNN):\n"
        "    def forward(self, x):\n"
        "        x.numpy()  # a host read fake tensors cannot answer\n"
        "        return super().forward(x)\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    run_dir = tmp_path / "run"
    result = in_process(*TINY, "trainer.epochs=1", "trainer.plan=true",
                        "model._target_=plan_host_models.ReadsValues",
                        f"hydra.run.dir={run_dir}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    said = result.stdout + result.stderr
    assert "No plan for this run" in said and "tensor subclasses" in said
    assert "plan" not in json.loads((run_dir / "summary.json").read_text())["ran"]


def test_pure_bf16_hands_a_language_models_logits_to_its_loss_without_a_float32_copy():
    """The chunked cross-entropy upcasts a chunk at a time: pure bf16 keeps its logits in
    bfloat16 (a float32 copy of them all was the step's largest tensor), and its step peaks
    below bf16 mixed precision's."""
    lm = ["model=gpt", "dataset=text", "dataset.vocab_size=50304", "dataset.tokenizer=bpe",
          "model.block_size=256", "dataset.batch_size=16"]  # fmt: skip
    pure, mixed = plan_rows([*lm, "precision=bf16_pure,bf16"], CUDA)
    logits = (16 * 256, 50304)  # 786 MiB in float32: the loss takes it in chunks of 256 MiB
    for phase in ("train_step", "validation"):
        shapes = {(tuple(t["shape"]), t["dtype"]) for t in pure["largest"][phase]}
        assert (logits, "float32") not in shapes, pure["largest"][phase]
    assert pure["peak_bytes"]["train_step"] < mixed["peak_bytes"]["train_step"]
