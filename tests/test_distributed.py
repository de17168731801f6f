"""Scale-out on CPU as a user runs it: torchrun with two gloo processes (DDP, FSDP2), a
submitit_local sweep whose jobs each run DDP over two tasks, and the pieces underneath."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpexp.data.synthetic import SyntheticData
from mpexp.distributed import World, hydra_overrides_for_rank, start_world
from mpexp.errors import ConfigError
from mpexp.run.runner import train
from mpexp.tracking.run_context import RunContext
from tests.conftest import ROOT, TINY, job_dir, make_cfg, run_cli
from tests.test_training import read_metrics

TORCHRUN = ("torch.distributed.run", "--standalone", "--nproc_per_node=2")
# TINY for one epoch; dataset.batch_size is the optimizer step's on any number of ranks: two
# ranks take 32 samples each of the same global batch of 64 that the one-process runs use
ONE_EPOCH = [*TINY, "trainer.epochs=1"]
GLOBAL = "dataset.batch_size=64"
STEPS = 1024 // 64


def only_run_dir(cwd: Path) -> Path:
    """The run's directory, after checking that nothing else was written in `cwd`."""
    assert [p.name for p in cwd.iterdir()] == ["outputs"]
    (run_dir,) = (cwd / "outputs").glob("*/*")
    return run_dir


def losses(run_dir: Path) -> list[float]:
    steps, _ = read_metrics(run_dir)
    return [r["train/loss"] for r in steps if "train/loss" in r]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("ddp")
    result = run_cli(
        *TORCHRUN,
        "-m",
        "mpexp.train",
        "trainer.strategy=ddp",
        *ONE_EPOCH,
        GLOBAL,
        "wandb.mode=offline",
        "trainer.plan=true",  # rank 0 plans, rank 1 takes its answer
        cwd=cwd,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return cwd


def test_ddp_rank_zero_alone_writes_and_the_replicas_stay_identical(ddp_run):
    run_dir = only_run_dir(ddp_run)
    steps, epochs = read_metrics(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # each step once
    assert len(epochs) == 1
    assert (run_dir / "train.log").read_text().count("Epoch: 1,") == 1
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    ran = summary["ran"]
    assert (ran["strategy"], ran["world_size"], ran["backend"]) == ("ddp", 2, "gloo")
    assert ran["steps_per_epoch"] == STEPS
    # every rank's weights compared bit for bit at the end of training
    assert ran["replicas_identical"] is True
    # the plan counts DDP's buckets, which hold the gradients (gradient_as_bucket_view)
    held = ran["plan"]["bytes"]
    assert held["ddp_buckets"] == ran["bytes_weights"] and held["gradients"] == 0


def test_ddp_on_two_ranks_matches_one_process_with_the_same_global_batch(ddp_run, tmp_path):
    train(make_cfg(*ONE_EPOCH, GLOBAL), RunContext(tmp_path))
    ddp, single = losses(only_run_dir(ddp_run)), losses(tmp_path)
    assert len(ddp) == len(single) == STEPS
    assert ddp == pytest.approx(single, rel=1e-4)  # the logged loss is the mean over ranks

    _, (ddp_epoch,) = read_metrics(only_run_dir(ddp_run))
    _, (single_epoch,) = read_metrics(tmp_path)
    assert ddp_epoch["val/loss"] == pytest.approx(single_epoch["val/loss"], rel=1e-4)


@pytest.mark.slow
def test_fsdp_in_fp16_trains_like_one_process(tmp_path):
    fp16 = [
        "precision=fp16",
        "loss_scaling.init_scale=1024",
        "diagnostics.grad_stats_every=8",
        "diagnostics.overflow_attribution=true",
    ]
    cwd = tmp_path / "fsdp"
    cwd.mkdir()
    fsdp_args = ["trainer.strategy=fsdp", *ONE_EPOCH, GLOBAL, *fp16]
    result = run_cli(*TORCHRUN, "-m", "mpexp.train", *fsdp_args, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = only_run_dir(cwd)
    ran = json.loads((run_dir / "summary.json").read_text())["ran"]
    assert (ran["strategy"], ran["world_size"], ran["autocast_dtype"]) == ("fsdp", 2, "float16")

    single_summary = train(make_cfg(*ONE_EPOCH, GLOBAL, *fp16), RunContext(tmp_path / "single"))
    assert ran["parameters"] == single_summary["ran"]["parameters"]  # counted before sharding
    fsdp, single = losses(run_dir), losses(tmp_path / "single")
    assert len(fsdp) == STEPS
    # fp16 rounds per rank's batch of 32 rather than over all 64: close, not equal
    assert fsdp == pytest.approx(single, abs=5e-3)

    # diagnostics count every rank's shard once: every element of the whole model is either an
    # exact zero or in the histogram, and the fractions are close to one process's
    def stats(run):
        return [r for r in read_metrics(run)[0] if "diag/total/zero" in r]

    fsdp_stats, single_stats = stats(run_dir), stats(tmp_path / "single")
    assert [r["step"] for r in fsdp_stats] == [r["step"] for r in single_stats] == [8, 16]
    elements = ran["parameters"]
    for row in fsdp_stats:
        histogram = sum(row["diag/total/log2_hist"]["counts"])
        assert histogram + round(row["diag/total/zero"] * elements) == elements
    first, first_single = fsdp_stats[0], single_stats[0]
    assert first["diag/total/zero"] == pytest.approx(first_single["diag/total/zero"], abs=0.01)


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("checks")
    script = str(ROOT / "tests" / "distributed_checks.py")
    result = run_cli(*TORCHRUN, script, str(out), cwd=out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, rank in enumerate(ranks):
        rank["threads_after"] = json.loads((out / f"threads{r}.json").read_text())
    return ranks


def test_a_torn_down_world_leaves_no_gloo_thread_to_pythons_shutdown(checks):
    # FSDP2's device mesh kept the default group, and its worker threads, alive past
    # destroy_process_group: now and then rank 1 aborted in Python's shutdown ("terminate
    # called without an active exception") after every check had passed
    for rank in checks:
        assert rank["threads_after"] == []


def test_under_ddp_an_overflow_on_one_rank_skips_the_step_on_both(checks):
    # DDP averages gradients before the scaler unscales them: rank 1's inf reaches rank 0 too
    for rank in checks:
        assert rank["ddp"] == {"skipped": 1.0, "scale": 512.0, "unchanged": True}


def test_fsdp_gathers_fp16_weights_and_skips_together(checks):
    for rank in checks:
        fsdp = rank["fsdp"]
        assert fsdp["dtypes_in_forward"] == {"linear": "torch.float16", "norm": "torch.float32"}
        assert (fsdp["skipped"], fsdp["scale"]) == (1.0, 512.0)


def test_fsdp_overflow_flags_are_all_reduced_once(checks):
    # one all-reduce agrees on non-finite losses; the flags of the sharded unscale take a second
    # only where torch's DTensor dispatch does not combine them itself
    for rank in checks:
        fsdp = rank["fsdp"]
        assert fsdp["all_reduces_in_step"] == (1 if fsdp["torch_combines_flags"] else 2)


def test_fsdp_diagnostics_count_every_shard_once(checks):
    for rank in checks:
        fsdp, single = rank["fsdp_diagnostics"]["fsdp"], rank["fsdp_diagnostics"]["single"]
        assert fsdp == single  # every figure, histograms included, as one process counts them
        (names,) = [r for r in fsdp if "diag/nonfinite_params" in r]
        assert names["diag/nonfinite_params"] == "4.weight"  # its inf is on rank 1's shard only
        (stats,) = [r for r in fsdp if "diag/total/zero" in r]
        assert 0 < stats["diag/total/underflow"] < 1 and stats["diag/total/overflow"] > 0


def test_fsdp_calibration_settles_on_the_whole_models_maximum(checks):
    # 3.0 * 2048 < 65504 / 8 <= 3.0 * 4096
    for rank in checks:
        assert rank["fsdp_calibration"] == {"calibrated_scale": 2048.0, "calibration_max_grad": 3.0}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_skipped_step_leaves_batchnorm_statistics_alone_on_every_rank(checks, strategy):
    for rank in checks:
        assert rank[f"{strategy}_buffers"] == {"skipped": 1.0, "kept": True, "moved_after": True}


def test_skip_together_sums_the_overflow_flags_over_ranks(checks):
    rank0, rank1 = checks
    assert rank0["alone"] == {"skipped": 0.0, "scale": 1024.0}  # rank 0 cannot see rank 1's inf
    assert rank1["alone"] == {"skipped": 1.0, "scale": 512.0}
    assert rank0["together"] == rank1["together"] == {"skipped": 1.0, "scale": 512.0}


def test_replica_check_tells_identical_from_diverged_weights(checks):
    for rank in checks:
        assert rank["replicas"] == {"same_seed": True, "seed_per_rank": False}


def test_under_ddp_the_model_and_its_loss_compile_as_one_graph_and_sync_once_a_step(checks):
    # DDP wraps the compiled model with its loss (nanoGPT's order): before, compiling the
    # Objective around DDP broke the graph at DDP's forward (2 graphs, 3 breaks), the logits
    # leaving the model's graph whole
    for rank in checks:
        ddp = rank["ddp_compiled"]
        assert (ddp["graphs"], ddp["breaks"]) == (1, 0)
        assert ddp["model_and_loss"] == [[True, True]]  # the embedding and the logsumexp
        # two optimizer steps of two micro-batches a rank: one all-reduce a step (no_sync)
        assert ddp["all_reduces"] == 2
    assert checks[0]["ddp_compiled"]["weights"] == checks[1]["ddp_compiled"]["weights"]


def test_under_fsdp_each_block_is_compiled_before_it_is_sharded(checks):
    # torchtitan's order: a block's graph (shared by both blocks) and the loss's, no break
    for rank in checks:
        fsdp = rank["fsdp_compiled"]
        assert (fsdp["graphs"], fsdp["breaks"]) == (2, 0)
        assert fsdp["block"] == [True, False]
        assert fsdp["model_and_loss"] == [[False, False], [False, True]]


@pytest.mark.parametrize("data", ["windows", "device", "dataloader"])
def test_each_rank_validates_half_and_finds_one_processs_metrics(checks, data):
    for rank in checks:
        assert rank["split_validation"][data] == {"samples": 10, "same": True, "keys": True}


def test_the_token_scan_is_split_among_ranks_and_each_refuses_what_one_found(checks):
    rank0, rank1 = (rank["split_token_scan"] for rank in checks)
    mine = [tuple(s) for s in rank0["mine"]], [tuple(s) for s in rank1["mine"]]
    assert len(mine[0]) == len(mine[1]) == len(rank0["all"]) // 2
    assert sorted(mine[0] + mine[1]) == sorted(tuple(s) for s in rank0["all"])
    # the id out of range lies in rank 1's share alone: rank 0 refuses the files too
    for rank in (rank0, rank1):
        assert "val.bin holds token id 99 at position 300" in rank["said"]


@pytest.mark.slow
def test_submitit_local_sweep_runs_ddp_inside_each_job(tmp_path, monkeypatch):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e .[slurm]")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # four processes on two cores, as torchrun sets
    result = run_cli(
        "mpexp.train",
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        "trainer.strategy=ddp",
        *ONE_EPOCH,
        GLOBAL,
        "dataset.train_size=256",
        "precision=fp32,bf16",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    for number, precision in enumerate(("fp32", "bf16")):
        job = job_dir(sweep, number)
        steps, epochs = read_metrics(job)
        assert [r["step"] for r in steps] == [1, 2, 3, 4]  # 256 samples, global batch 64
        assert len(epochs) == 1
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "finished"
        assert summary["ran"]["precision"] == precision
        assert summary["ran"]["world_size"] == 2
        assert summary["ran"]["replicas_identical"] is True
        assert (job / "train.log").read_text().count("Epoch: 1,") == 1


class Indexed(SyntheticData):
    """The synthetic set with each training sample labelled by its index, so that a shard can be
    read back."""

    def load(self):
        (images, labels), val, classes = super().load()
        return (images, torch.arange(len(labels))), val, classes


@pytest.mark.parametrize(("loader", "world"), [("device", 3), ("dataloader", 3), ("device", 1)])
def test_ranks_share_each_epoch_without_overlap(loader, world):
    def shard_batches(rank):
        data = Indexed(train_size=100, val_size=8, batch_size=5, loader=loader, seed=0)
        data.setup(torch.device("cpu"))
        data.shard(rank, world)
        batches = data.train_batches(epoch=2, seed=7, device=torch.device("cpu"))
        return data, [labels.tolist() for _, labels in batches]

    seen = []
    for rank in range(world):
        data, batches = shard_batches(rank)
        assert len(batches) == data.steps_per_epoch() == 100 // world // 5
        seen += [i for batch in batches for i in batch]
    assert len(seen) == len(set(seen)) == 100 // world // 5 * 5 * world


def test_device_and_dataloader_shards_are_the_same_samples():
    def shard(loader):
        data = Indexed(train_size=64, val_size=8, batch_size=4, loader=loader, seed=0)
        data.setup(torch.device("cpu"))
        data.shard(1, 2)
        return [labels.tolist() for _, labels in data.train_batches(3, 42, torch.device("cpu"))]

    assert shard("device") == shard("dataloader")


def test_ddp_without_a_launcher_says_how_to_start_it(tmp_path):
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node=2"):
        train(make_cfg(*TINY, "trainer.strategy=ddp"), RunContext(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_single_strategy_among_launched_processes_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"trainer\.strategy=ddp"), start_world("single", None):
        pass


def test_a_sweep_inside_torchrun_is_refused_and_only_rank_zero_lets_hydra_write(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert hydra_overrides_for_rank(["trainer.strategy=ddp"]) == []
    with pytest.raises(SystemExit, match="cannot run inside a torchrun launch"):
        hydra_overrides_for_rank(["-m", "precision=fp16,bf16"])
    monkeypatch.setenv("RANK", "1")
    assert "hydra.output_subdir=null" in hydra_overrides_for_rank(["trainer.strategy=ddp"])


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_finished_replica_leaves_without_pythons_shutdown(tmp_path, rank):
    # In Python's shutdown a gloo worker thread freeing a tensor aborted rank 1 now and then
    # (exit -6), and torchrun failed a run that had finished. Rank 1 now skips that shutdown, its
    # output flushed; rank 0, which writes the run's files, ends as usual.
    script = (
        "import atexit, logging, sys\n"
        "from mpexp.distributed import leave_if_replica\n"
        "atexit.register(lambda: sys.stdout.write('shut down\\n'))\n"
        "logging.basicConfig()\n"
        "logging.getLogger('mpexp').warning('a warning')\n"
        "print('trained', end='')\n"
        "leave_if_replica()\n"
    )
    env = {**os.environ, "RANK": rank, "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0 and "a warning" in result.stderr
    assert result.stdout == ("trained" if rank == "1" else "trainedshut down\n")


def test_a_single_process_world_changes_nothing():
    world = World(torch.device("cpu"))
    model = torch.nn.Linear(2, 2)
    assert world.shard(model, None) is model and world.replicate(model) is model
    assert world.reduce_epoch({"perf/samples_per_s": 3.0}) == {"perf/samples_per_s": 3.0}
    assert world.check_replicas(model) == {}


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("ranks", "strategy"),
    [
        (1, "ddp"),
        pytest.param(2, "ddp", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                         reason="needs two CUDA GPUs")),
        pytest.param(2, "fsdp", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                          reason="needs two CUDA GPUs")),
    ],
)  # fmt: skip
def test_gpus_train_over_nccl(tmp_path, ranks, strategy):
    """DDP over NCCL on one GPU (any GPU machine has that), and DDP and FSDP on two."""
    launch = (*TORCHRUN[:-1], f"--nproc_per_node={ranks}")
    args = [f"trainer.strategy={strategy}", *ONE_EPOCH, GLOBAL, "precision=bf16"]
    result = run_cli(*launch, "-m", "mpexp.train", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    ran = json.loads((run_dir / "summary.json").read_text())["ran"]
    assert (ran["backend"], ran["device"], ran["world_size"]) == ("nccl", "cuda:0", ranks)
    assert ran.get("replicas_identical", True) is True
    _, epochs = read_metrics(run_dir)
    assert "mem/peak_allocated_mib" in epochs[0]


@pytest.mark.slow  # torchrun and a run of its own: about 9 s on 2 cores
def test_ddp_with_accumulation_matches_one_process(tmp_path):
    """Micro-batches skip DDP's gradient all-reduce until the last one: still the same result."""
    cwd = tmp_path / "ddp"
    cwd.mkdir()
    args = ["trainer.strategy=ddp", *ONE_EPOCH, GLOBAL, "trainer.accumulate=4"]  # 2 a rank
    result = run_cli(*TORCHRUN, "-m", "mpexp.train", *args, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train(make_cfg(*ONE_EPOCH, GLOBAL, "trainer.accumulate=4"), RunContext(tmp_path / "one"))
    ddp, single = losses(only_run_dir(cwd)), losses(tmp_path / "one")
    assert ddp == pytest.approx(single, rel=1e-4)


@pytest.mark.slow  # torchrun and a run of its own per strategy, in emulated bf16
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bf16_pure_rounds_alike_on_every_rank_and_counts_every_shard(tmp_path, strategy):
    pure = ["precision=bf16_pure_kahan", "optimizer=adam", "optimizer.lr=1e-4"]
    cwd = tmp_path / strategy
    cwd.mkdir()
    args = [f"trainer.strategy={strategy}", *ONE_EPOCH, GLOBAL, *pure]
    result = run_cli(*TORCHRUN, "-m", "mpexp.train", *args, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = only_run_dir(cwd)
    ran = json.loads((run_dir / "summary.json").read_text())["ran"]
    assert (ran["weights_dtype"], ran["update_rounding"], ran["world_size"]) == (
        "bfloat16",
        "kahan",
        2,
    )
    assert ran.get("replicas_identical", True) is True  # DDP's replicas rounded alike

    train(make_cfg(*ONE_EPOCH, GLOBAL, *pure), RunContext(tmp_path / "single"))

    def lost(run):
        return [r["opt/updates_lost"] for r in read_metrics(run)[0] if "opt/updates_lost" in r]

    # every shard counted once: the share is close to one process's (rounding differs a little)
    assert lost(run_dir) == pytest.approx(lost(tmp_path / "single"), abs=0.05)
