#!/usr/bin/env bash
# The GPU proof in one command, for a CUDA machine (an H100 or H200): the GPU-marked tests; the
# benchmark (DeepCNN on 60,000 MNIST-format samples per epoch, batch 256) eager for all four
# precisions against the tutorial's loop and the bare loop (one timed epoch each), then fp16 and
# bf16 against the bare loop with channels_last and compiled with CUDA graphs; and a
# four-precision sweep with its report. EXTRA=1 adds plain torch.compile, fp32 with CUDA graphs,
# the profiler's view of a step (scripts/profile_step.py) and ViT's step in bf16 against fp8.
# Everything lands in one folder, as logs, JSON and markdown; the sweep is tarred without its
# checkpoints. From its parts' times on an H100 (docs/measurements/h100-2026-11-22/README.md) it
# should end inside 8 minutes; it has not yet run end to end in one call.
#
#   scripts/gpu_proof.sh [OUT_DIR]            # default: gpu-proof/
#
# On a machine without hydra-core, omegaconf or wandb, prepare their wheels first as
# ../shared/device/README.md says, then start with its install line. Record what it measured in
# docs/benchmarks.md: nothing there is estimated.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-proof}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=offline WANDB_SILENT=true
status=0
step() {  # name, command...: run one part, keep its output, go on even if it fails
  local name="$1"
  shift
  echo "== $name: $*" | tee -a "$out/steps.log"
  local began=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - began)) s" | tee -a "$out/steps.log"
  [ "$rc" -eq 0 ] || status=1
  tail -n 30 "$out/$name.log"
}

step machine bash -c 'nvidia-smi; python3 -c "import torch; print(torch.__version__, \
  torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"'
step gpu-tests python3 -m pytest -m gpu -q -p no:cacheprovider
# all four precisions against the tutorial's loop and the bare loop, eager
step bench-eager python3 scripts/bench.py --bare --epochs 1 --json "$out/bench-eager.json"
# the speed switches: channels_last alone, then compiled with CUDA graphs and channels_last (the
# tutorial's loop takes none of them)
step bench-channels-last python3 scripts/bench.py --bare --no-tutorial --precisions fp16,bf16 \
  --epochs 2 --json "$out/bench-channels-last.json" trainer.channels_last=true
step bench-graphs python3 scripts/bench.py --bare --no-tutorial --precisions fp16,bf16 \
  --epochs 2 --json "$out/bench-graphs.json" trainer.compile=true \
  trainer.compile_mode=reduce-overhead trainer.channels_last=true
step sweep python3 -m mpexp.train -m experiment=quickstart model=deepcnn \
  precision=fp32,tf32,fp16,bf16 trainer.device=cuda trainer.epochs=4 \
  dataset.train_size=60000 dataset.batch_size=256 "hydra.sweep.dir=$out/sweep"
if [ "${EXTRA:-0}" = 1 ]; then  # about 5 minutes more
  step bench-compile python3 scripts/bench.py --bare --no-tutorial --precisions bf16 \
    --epochs 2 --json "$out/bench-compile.json" trainer.compile=true
  step bench-graphs-fp32 python3 scripts/bench.py --bare --no-tutorial --precisions fp32 \
    --epochs 2 --json "$out/bench-graphs-fp32.json" trainer.compile=true \
    trainer.compile_mode=reduce-overhead trainer.channels_last=true
  # where a step's time goes: wall against device-busy time, eager and with CUDA graphs
  step profile python3 scripts/profile_step.py --precisions fp32,bf16,fp16 \
    --json "$out/profile.json"
  step profile-graphs python3 scripts/profile_step.py --precisions bf16,fp16 --warmup 20 \
    --json "$out/profile-graphs.json" trainer.compile=true \
    trainer.compile_mode=reduce-overhead trainer.channels_last=true
  step profile-vit-fp8 python3 scripts/profile_step.py --model vit --precisions bf16,fp8 \
    --json "$out/profile-vit-fp8.json" trainer.compile=true
fi
tar --exclude=checkpoints -czf "$out/sweep.tar.gz" -C "$out" sweep && rm -rf "$out/sweep"
echo "results in $out/ (steps.log lists each part's exit status and time)"
exit "$status"
