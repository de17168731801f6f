"""scripts/bench.py --device cpu, at a tiny size, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def run_script(name: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    """One of scripts/ as a user runs it, from another folder; it must succeed."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.slow
def test_cpu_benchmark_prints_its_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--train-size", "256", "--batch-size", "64", "--epochs", "1",
            "--process-repeats", "1", "--process-size", "1", "256"]  # fmt: skip
    result = run_script("bench.py", [*args, "--json", str(out)], tmp_path)
    assert "precision | tutorial s/ep | mpexp s/ep | vs tutorial" in result.stdout
    assert "fp32 |" in result.stdout and "overhead" in result.stdout

    bench = json.loads(out.read_text())
    (row,) = bench["rows"]
    assert row["precision"] == "fp32" and row["speedup_vs_fp32"] == 1.0
    assert bench["train_size"] == 256 and bench["device"] == "cpu"
    for key in ("tutorial_s_per_epoch", "mpexp_s_per_epoch", "bare_s_per_epoch"):
        assert row[key] > 0
    assert row["speedup_vs_tutorial"] == row["tutorial_s_per_epoch"] / row["mpexp_s_per_epoch"]
    assert abs(bench["gflop_per_sample"] - 0.0060) < 0.001  # simplecnn width 16 on 1x28x28

    # the skipped-step rollback: a few multi-tensor operators, not three per buffer
    rollback = bench["rollback"]
    assert rollback["buffers"] == 42  # DeepCNN: 14 BatchNorm layers of 3
    assert rollback["foreach"]["ops"] <= 10 < 3 * 42 <= rollback["per_buffer"]["ops"]
    assert rollback["foreach"]["us"] > 0 and rollback["per_buffer"]["us"] > 0
    assert "rollback | operators | us/step" in result.stdout

    # the whole quickstart process, with W&B and without, against a bare script doing the same
    # training
    process = bench["process"]
    assert (process["epochs"], process["train_size"]) == (1, 256)
    assert (
        len(process["mpexp_s"]) == len(process["mpexp_no_wandb_s"]) == len(process["bare_s"]) == 1
    )
    assert process["ratio_median"] == process["mpexp_s"][0] / process["bare_s"][0]
    no_wandb = process["mpexp_no_wandb_s"][0] / process["bare_s"][0]
    assert process["ratio_no_wandb_median"] == no_wandb
    assert "whole process, experiment=quickstart" in result.stdout
    assert "mpexp, W&B disabled |" in result.stdout


@pytest.mark.slow
def test_vit_in_bf16_against_fp8_as_a_gpu_session_will_run_it(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--model", "vit", "--precisions", "bf16,fp8", "--train-size",
            "256", "--batch-size", "64", "--epochs", "1", "--process-repeats", "0",
            "--json", str(out), "model.patch_size=7", "model.width=32", "model.depth=1",
            "model.heads=2"]  # fmt: skip
    result = run_script("bench.py", args, tmp_path)
    assert "| vs fp32 | vs bf16 |" in result.stdout
    bf16, fp8 = json.loads(out.read_text())["rows"]
    assert (bf16["precision"], fp8["precision"]) == ("bf16", "fp8")
    assert bf16["speedup_vs_bf16"] == 1.0 and bf16["speedup_vs_fp32"] is None
    assert fp8["speedup_vs_bf16"] == bf16["mpexp_s_per_epoch"] / fp8["mpexp_s_per_epoch"]
    assert "precision=fp8 runs emulated on CPU" in result.stderr


@pytest.mark.slow  # the profiler over a benchmark's steps
def test_profile_step_names_where_a_steps_time_goes(tmp_path):
    """scripts/profile_step.py on CPU, tiny: each precision's wall time per step and the
    operators that took the most CPU time, the convolutions among them (named by the kernel this
    CPU takes: oneDNN's convolution, or aten's _slow_conv2d where bf16 has no instructions)."""
    out = tmp_path / "profile.json"
    args = ["--device", "cpu", "--model", "simplecnn", "--precisions", "fp32,bf16",
            "--steps", "2", "--warmup", "1", "--batch-size", "16", "--json", str(out),
            "model.width=8"]  # fmt: skip
    result = run_script("profile_step.py", args, tmp_path)
    assert "fp32: " in result.stdout and "bf16: " in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["precision"] for r in rows] == ["fp32", "bf16"]
    for row in rows:
        assert row["wall_ms_per_step"] > 0
        assert row["device_busy_ms_per_step"] is None  # no GPU: no kernel timeline
        ops = [t["op"] for t in row["top"]]
        assert any("conv" in op for op in ops), ops


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["text", "tokens"])
def test_the_language_model_benchmark_compares_the_command_with_a_plain_loop(tmp_path, dataset):
    out = tmp_path / "bench_lm.json"
    args = ["--epochs", "2", "--train-size", "128", "--batch-size", "16", "--repeats", "2",
            "--dataset", dataset, "--json", str(out), "model.n_embd=32"]  # fmt: skip
    result = run_script("bench_lm.py", args, tmp_path)
    assert "fp32  mpexp" in result.stdout and "bf16  mpexp" in result.stdout
    rows = json.loads(out.read_text())["results"]
    assert [r["precision"] for r in rows] == ["fp32", "bf16"]
    for row in rows:
        assert len(row["ratios"]) == 2 and row["mpexp_tokens_per_s"] > 0
        assert row["plain_tokens_per_s"] > 0 and row["steps"] == 2 * 128 // 16
