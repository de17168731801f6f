"""What a plan counts beyond one process's step, each kind on a line of its own: the data a
dataset keeps on the device, DDP's buckets, FSDP's shares, the EMA copy, pure bf16's update
chunks at the planned device's size, a captured step's pool beside validation; the margin it
leaves, the devices it knows by name and the time it estimates."""

from __future__ import annotations

import json

import pytest

from mpexp.plan.__main__ import main as plan_main
from mpexp.plan.before_run import against_measured
from mpexp.plan.devices import TYPICAL_MFU, named
from mpexp.plan.rows import MARGIN_LEAVES_OUT, Target, plan_rows
from mpexp.plan.table import table
from mpexp.precision.pure_step import CPU_CHUNK, CUDA_CHUNK
from tests.conftest import TINY

CUDA = Target("cuda")
IMAGES = ["dataset.channels=3", "dataset.height=32", "dataset.width=32"]


def test_the_data_held_on_the_device_is_planned_and_grows_with_train_size():
    """loader=device keeps every sample on the device as float32 (with its label and its place
    in the epoch's order): 200,000 images of 3x32x32 are 2.29 GiB, which the plan said fit in
    53 MiB before it counted them."""
    one, two = plan_rows([*TINY, *IMAGES, "dataset.train_size=1000,2000"], CUDA)
    per_sample = 3 * 32 * 32 * 4 + 8 + 8
    assert two["bytes"]["data"] - one["bytes"]["data"] == 1000 * per_sample
    assert two["need_bytes"] - one["need_bytes"] == 1000 * per_sample
    assert "the data set, held on the device" in table([one])


def test_an_image_folder_on_a_gpu_holds_the_next_batch_and_its_decoding(tmp_path):
    for name in ("cat", "dog"):
        (tmp_path / "train" / name).mkdir(parents=True)
    folder = ["dataset=image_folder", f"dataset.path={tmp_path}", "dataset.image_size=32",
              "dataset.batch_size=16", "model=simplecnn", "model.width=4"]  # fmt: skip
    decoded, cached = plan_rows([*folder, "dataset.decode=gpu,cpu"], CUDA)
    assert decoded["bytes"]["next_batch"] == cached["bytes"]["next_batch"] == 16 * (3 * 32**2 + 16)
    assert decoded["bytes"]["gpu_decoder"] > 0 == cached["bytes"]["gpu_decoder"]
    assert decoded["need_bytes"] - cached["need_bytes"] == decoded["bytes"]["gpu_decoder"]
    assert decoded["bytes"]["data"] == 0  # read from its files, a batch at a time


@pytest.fixture(scope="module")
def shared() -> dict[str, dict]:
    """TINY's row on one process (32 samples a step), captured and with an EMA, and eager; and
    on two processes (64 samples: 32 each) under DDP and under FSDP."""
    one = [*TINY, "dataset.batch_size=32"]
    rows = {"single": plan_rows([*one, "trainer.ema_decay=0.99"], CUDA)[0]}
    (rows["eager"],) = plan_rows([*one, "trainer.cuda_graph=false"], CUDA)
    two = Target("cuda", processes=2)
    for strategy in ("ddp", "fsdp"):
        (rows[strategy],) = plan_rows([*TINY, f"trainer.strategy={strategy}"], two)
    return rows


def test_ddps_buckets_hold_the_gradients_through_the_whole_run(shared):
    """gradient_as_bucket_view: the gradients are views of DDP's buckets (no second copy),
    which are held through the forward pass and validation too."""
    single, ddp = shared["eager"], shared["ddp"]  # DDP's step is not captured either
    assert ddp["bytes"]["ddp_buckets"] == single["bytes"]["gradients"] > 0
    assert ddp["bytes"]["gradients"] == 0
    held = single["bytes"]["gradients"]
    assert ddp["peak_bytes"]["validation"] == single["peak_bytes"]["validation"] + held
    assert ddp["peak_bytes"]["train_step"] >= single["peak_bytes"]["train_step"]
    assert "ddp buckets" in table([ddp])


def test_fsdp_plans_one_ranks_shares_and_its_gathered_units(shared):
    single, fsdp = shared["eager"], shared["fsdp"]
    for kind in ("weights", "gradients", "optimizer"):
        assert fsdp["bytes"][kind] == -(-single["bytes"][kind] // 2)
    assert fsdp["bytes"]["fsdp_gathered"] > 0 and fsdp["estimated"] == ["fsdp"]
    assert fsdp["need_bytes"] < single["need_bytes"] + fsdp["bytes"]["fsdp_gathered"]
    assert "FSDP: one rank's shares" in table([fsdp])


def test_the_ema_copy_is_held_in_float32(shared):
    single = shared["single"]
    assert single["bytes"]["weight_average"] == 4 * single["parameters"]
    assert shared["eager"]["bytes"]["weight_average"] == 0
    assert "weight average" in table([single])


def test_a_captured_step_needs_its_pool_and_validations_extra_beside_it(shared):
    """On a GPU the step runs as a CUDA graph whose pool stays reserved while validation
    allocates beside it: the need is the step's peak and validation's extra, not the larger."""
    captured, eager = shared["single"], shared["eager"]
    assert captured["captured"] and not eager["captured"]
    peaks = captured["peak_bytes"]
    assert captured["need_bytes"] > max(peaks.values())
    assert eager["need_bytes"] == max(eager["peak_bytes"].values())
    assert "stays reserved while validation allocates" in table([captured])
    # what a captured run's plan is held to: the reserved bytes, which hold the pool
    plan = {"need_bytes": 2**30, "peak_bytes": peaks, "captured": True}
    measured = {"mem/peak_allocated_mib": 512.0, "mem/peak_reserved_mib": 1100.0}
    assert against_measured(plan, measured)["mem/plan_error"] == pytest.approx(1024 / 1100 - 1)
    plan["captured"] = False
    assert against_measured(plan, measured)["mem/plan_error"] == pytest.approx(1)


def test_pure_bf16s_counting_step_is_planned_with_chunks_of_the_planned_devices_size():
    """Pure bf16 counts its lost updates on each log interval's last step (every 50th here)
    through a float32 workspace of one batch: 2 Mi elements on CUDA, 256 Ki on a CPU, whatever
    machine plans it. A steady state holds such a step: the plan rehearses one. A CPU keeps the
    workspace from step to step (validation holds it too); a GPU lets it go after each step."""
    lm = ["model=gpt", "dataset=text", "dataset.vocab_size=50304", "dataset.tokenizer=bpe",
          "model.n_layer=1", "model.n_embd=128", "model.block_size=16", "dataset.batch_size=1",
          "precision=bf16_pure", "diagnostics.updates_lost=null,false"]  # fmt: skip
    cuda, cuda_uncounted = plan_rows(lm, CUDA)
    cpu, cpu_uncounted = plan_rows(lm, Target("cpu"))
    # the embedding (6.4 M elements) is cut into batches of the chunk's size on either device
    shapes = {(tuple(t["shape"]), t["dtype"]) for t in cuda["largest"]["train_step"]}
    assert ((CUDA_CHUNK,), "float32") in shapes, cuda["largest"]["train_step"]
    assert cpu["optimizer_workspace"]["elements"] == CPU_CHUNK
    assert cuda["optimizer_workspace"]["elements"] == CUDA_CHUNK
    # the workspace: at least the weight's, gradient's and both moments' float32 copies
    assert cuda["peak_bytes"]["train_step"] >= sum(cuda["bytes"].values()) + 16 * CUDA_CHUNK
    growth = {
        phase: cpu["peak_bytes"][phase] - cpu_uncounted["peak_bytes"][phase]
        for phase in ("train_step", "validation")
    }
    assert min(growth.values()) >= 16 * CPU_CHUNK, growth
    # a GPU's validation holds the count and where the batches' pieces start, no workspace
    kept = cuda["peak_bytes"]["validation"] - cuda_uncounted["peak_bytes"]["validation"]
    assert 0 <= kept < 64 * 1024, kept


def test_the_margin_says_what_it_leaves_out_and_a_named_device_gives_memory_and_time(capsys):
    plan_main([*TINY, "--device-memory", "h100", "precision=bf16"])  # options between overrides
    printed = capsys.readouterr().out
    assert "at most 90% of the device's memory" in printed
    assert all(left in printed for left in MARGIN_LEAVES_OUT)
    assert "79.19 GiB" in printed and "s/step is an estimate" in printed
    plan_main(TINY)  # no GPU here
    printed = capsys.readouterr().out
    assert "give --device-memory (80GiB, or a device's name: h100" in printed


def test_the_time_estimate_is_the_flops_at_a_typical_share_of_the_peak(tmp_path):
    out = tmp_path / "plan.json"
    plan_main([*TINY, "precision=bf16,fp32", "--device-memory", "a100-80gb", "--json", str(out)])
    bf16, fp32 = json.loads(out.read_text())["rows"]
    assert named("a100-80gb").memory == bf16["device_memory"]
    for row, peak in ((bf16, 312.0), (fp32, 19.5)):  # A100's dense peaks, TF32 off in fp32
        expected = row["flops_per_step"] / (peak * 1e12 * TYPICAL_MFU)
        assert row["seconds_per_step"] == pytest.approx(expected)


def test_an_unknown_device_name_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as ended:
        plan_main([*TINY, "--device-memory", "h1000"])
    said = capsys.readouterr().err
    assert ended.value.code == 2 and "h100, h100-80gb, h200" in said and "Traceback" not in said
