#!/usr/bin/env bash
# The GPU proof in one command, for a CUDA machine (an H100 or H200): the GPU-marked tests (the
# captured step against the eager one, bit for bit, among them); the benchmark (DeepCNN on 60,000
# MNIST-format samples per epoch, batch 256) with the defaults a user's command gets on a GPU
# (compiled, channels_last, the whole step as one CUDA graph) for fp16 and bf16 against the bare
# loop, then eager for all four precisions against the tutorial's loop; the profiler's view of the
# captured step; whole 10-epoch commands with a cold and a warm compile cache against eager; and a
# four-precision sweep with its report. Then the workloads' own parts: GPT-2 small (GPT-2's
# vocabulary) in bf16, fp16 and fp8 on the same fused, captured step, tokens/s and MFU beside a
# plain loop (lm); pure bf16 against bf16 mixed on GPT-2 small, speed and peak memory (pure);
# ViT-Base in fp8 against bf16 (vit, scripts/fp8_vit.sh's speed part); ResNet-18 with augmentation
# in fp32 against bf16 (resnet); an image folder at 224 px read by workers, from the resized cache
# and decoded on the GPU, each path's images/s beside ResNet-18's step and a run's data-wait share
# (images). EXTRA=1 adds ViT's step in bf16 against fp8 under the profiler. Every part
# runs under `timeout -k 10` (a compiling process may not stop on SIGTERM alone). Everything lands
# in one folder, as logs, JSON and markdown; the sweep is tarred without its checkpoints.
#
#   scripts/gpu_proof.sh [OUT_DIR]            # default: gpu-proof/
#   PARTS="tests bench" scripts/gpu_proof.sh   # some parts only: tests bench profile commands sweep
#                                              # lm pure vit resnet images
#
# The script ends inside BUDGET seconds (default 540, within one 10-minute device call): each part
# runs under the smaller of its own limit and the time left, and a part with under 30 s left is
# skipped and said so in steps.log. All parts need several calls, in order of value: "bench
# tests", then "lm pure", then "vit resnet images", then "profile commands sweep" (the default,
# PARTS unset, is the first and the last). Every part but the cold command shares
# one compile cache (TORCHINDUCTOR_CACHE_DIR, default /tmp/mpexp-inductor-cache, kept between
# calls on a warm machine), so a model compiled once is not compiled cold again.
#
# On a machine without hydra-core, omegaconf or wandb, prepare their wheels first as
# ../shared/device/README.md says, then start with its install line. Record what it measured in
# docs/benchmarks.md: nothing there is estimated.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-proof}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=offline WANDB_SILENT=true
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/mpexp-inductor-cache}"
status=0
deadline=$((SECONDS + ${BUDGET:-540}))
step() {  # name, seconds, command...: run one part, keep its output, go on even if it fails
  local name="$1" limit="$2" left=$((deadline - SECONDS))
  shift 2
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, ${left} s of BUDGET left" | tee -a "$out/steps.log"
    status=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (limit ${limit} s): $*" | tee -a "$out/steps.log"
  local began=$SECONDS
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - began)) s" | tee -a "$out/steps.log"
  [ "$rc" -eq 0 ] || status=1
  tail -n 30 "$out/$name.log"
}
data="$out/mnist"  # MNIST-format files of 60,000 learnable samples, as bench.py writes them
python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; \
  from bench import write_data; write_data(Path('$data'), 60000)"
run=(python3 -m mpexp.train dataset=mnist "dataset.root=$data" dataset.download=false
  trainer.device=cuda wandb.mode=disabled trainer.progress=false)

parts=" ${PARTS:-bench tests profile commands sweep} "
want() { [[ "$parts" == *" $1 "* ]]; }

step machine 30 bash -c 'nvidia-smi; python3 -c "import torch; print(torch.__version__, \
  torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"'
# most GPU tests compile their model cold: the longest part
want tests && step gpu-tests 330 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15
# the defaults of a user's command on a GPU, each precision in a process of its own
want bench && step bench-default 150 python3 scripts/bench.py --bare --no-tutorial --precisions fp16,bf16 \
  --epochs 3 --json "$out/bench-default.json"
# eager, all four precisions, against the tutorial's loop
want bench && step bench-eager 150 python3 scripts/bench.py --epochs 1 --json "$out/bench-eager.json" \
  trainer.eager=true
# where the captured step's time goes (wall against device-busy time, top kernels)
want profile && step profile 90 python3 scripts/profile_step.py --precisions bf16,fp16 --warmup 20 \
  --json "$out/profile.json"
# whole commands of 10 epochs: compile cache cold (a fresh one), then warm (the same), against eager
if want commands; then
  fresh="$out/command-cache"
  rm -rf "$fresh"
  step command-cold 150 env TORCHINDUCTOR_CACHE_DIR="$fresh" "${run[@]}" precision=bf16 \
    trainer.epochs=10 "hydra.run.dir=$out/cold"
  step command-warm 120 env TORCHINDUCTOR_CACHE_DIR="$fresh" "${run[@]}" precision=bf16 \
    trainer.epochs=10 "hydra.run.dir=$out/warm"
  step command-eager 120 "${run[@]}" precision=bf16 trainer.epochs=10 trainer.eager=true \
    "hydra.run.dir=$out/eager"
  rm -rf "$fresh"
fi
want sweep && step sweep 200 python3 -m mpexp.train -m experiment=quickstart model=deepcnn \
  precision=fp32,tf32,fp16,bf16 trainer.device=cuda trainer.epochs=4 \
  dataset.train_size=60000 dataset.batch_size=256 "hydra.sweep.dir=$out/sweep"
# GPT-2 small with GPT-2's 50,257-token vocabulary on uint16 token files (the standard library's
# bytes: speed does not depend on which ids occur), each precision in a process of its own,
# beside a plain compiled loop on the same windows; ran.step_path in each run's summary
want lm && step lm-gpt2 240 python3 scripts/bench_lm.py --device cuda --dataset tokens \
  --model gpt2_small --precisions bf16,fp16,fp8 --batch-size 16 --train-size 1024 --epochs 3 \
  --repeats 1 --json "$out/lm-gpt2.json" optimizer.lr=6e-4 dataset.vocab_size=50257
# pure bf16 against bf16 mixed: 60 steps of GPT-2 small each, their tokens/s and peak memory in
# the runs' metrics.jsonl (each validation's row: every 30 steps)
if want pure; then
  for p in bf16 bf16_pure bf16_pure_kahan; do
    step "pure-$p" 100 python3 -m mpexp.train model=gpt2_small dataset=text dataset.batch_size=16 \
      dataset.train_size=1024 dataset.val_size=64 trainer.epochs=null trainer.max_steps=60 \
      trainer.eval_every_steps=30 optimizer=adamw precision="$p" trainer.device=cuda \
      wandb.mode=disabled trainer.progress=false "hydra.run.dir=$out/pure-$p"
  done
fi
want vit && step vit-fp8 330 bash scripts/fp8_vit.sh "$out/vit" speed
# ResNet-18 (CIFAR's) with crops and flips, fp32 against bf16: 3 epochs of 50,000 images each
if want resnet; then
  for p in fp32 bf16; do
    step "resnet-$p" 120 python3 -m mpexp.train experiment=cifar10_resnet dataset=synthetic_cifar10 \
      dataset.train_size=50000 trainer.epochs=3 precision="$p" trainer.device=cuda \
      wandb.mode=disabled trainer.progress=false "hydra.run.dir=$out/resnet-$p"
  done
fi
# an image folder of 500x375 JPEGs at 224 px: each path's images/s beside ResNet-18's step, then
# 4 epochs of ResNet-18 in bf16 through each, whose perf/data_wait_share is the answer
if want images; then
  imgs="$out/images"
  step images-paths 150 python3 scripts/data_bench.py paths --workers 4 8 --repeats 2 \
    --step resnet18 --step-batch 128 --dir "$imgs"
  for how in workers:dataset.decode=cpu cache:dataset.cache=resized gpu:dataset.decode=gpu; do
    step "images-${how%%:*}" 90 python3 -m mpexp.train dataset=image_folder \
      "dataset.path=$imgs" model=resnet18 precision=bf16 dataset.batch_size=64 \
      dataset.num_workers=8 trainer.epochs=4 "${how#*:}" trainer.device=cuda wandb.mode=disabled \
      trainer.progress=false "dataset.cache_dir=$out/image-cache" "hydra.run.dir=$out/images-${how%%:*}"
  done
  rm -rf "$imgs" "$out/image-cache"
fi
if [ "${EXTRA:-0}" = 1 ]; then
  step profile-vit-fp8 120 python3 scripts/profile_step.py --model vit --precisions bf16,fp8 \
    --json "$out/profile-vit-fp8.json"
fi
rm -rf "$data"
for d in "$out"/*/; do rm -rf "$d/checkpoints"; done
[ -d "$out/sweep" ] && tar --exclude=checkpoints -czf "$out/sweep.tar.gz" -C "$out" sweep \
  && rm -rf "$out/sweep"
echo "results in $out/ (steps.log lists each part's exit status and time)"
exit "$status"
