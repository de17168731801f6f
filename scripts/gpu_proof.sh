#!/usr/bin/env bash
# The GPU proof in one device call, for a CUDA machine (an H100 or H200), in the order of what it
# is worth (issues 40 and 50):
#   shipped experiment=gpt2_small as it ships (491,520 tokens a step in 40 micro-batches), 30
#           steps validated every 10, in bf16, fp16, fp8 and bf16_pure_kahan: each run plans
#           itself first (trainer.plan), so its summary holds the planned peak beside the measured
#           one (mem/plan_error) with tokens/s and MFU; the sweep's report tabulates them;
#   models  the models people train (issue 55): a Llama of about 1 B parameters from its config
#           (model=hf_llama_1b at GPT-2's vocabulary), 20 steps of 8 windows of 2,048 tokens in
#           bf16 and fp8 (tokens/s, MFU, fp8's ratio); LoRA (experiment=finetune_lora) over a
#           save_pretrained Llama of 8 such layers, its measured peak against its own plan; timm's
#           ConvNeXt-T and ViT-S at 224 px on 1,000 classes, batch 128, in bf16 and fp8; each
#           run's summary gathered into models.json;
#   bench   DeepCNN on 60,000 MNIST-format samples per epoch, batch 256: the defaults a user's
#           command gets on a GPU (compiled, channels_last, the whole step as one CUDA graph:
#           ran.cuda_graph asserted) for fp16 and bf16 against the bare loop, then the same with
#           trainer.eager=true (ran.cuda_graph asserted false);
#   tests   the GPU-marked tests (the captured step against the eager one, bit for bit, among
#           them), on three workers;
#   lm      GPT-2 small on token files with GPT-2's 50,257-token vocabulary: bf16 against a plain
#           compiled loop, then fp16 and fp8; tokens/s, MFU and each run's step path;
#   vit     ViT-Base (experiment=fp8_vit) in bf16, fp8 tensorwise and fp8 rowwise, compiled;
#   resnet  ResNet-18 (CIFAR's) with crops and flips, fp32 against bf16;
#   images  an image folder of 500x375 JPEGs at 224 px: each path's images/s beside ResNet-18's
#           step, then ResNet-18 in bf16 through workers, the resized cache and GPU decoding,
#           whose perf/data_wait_share is the answer;
#   pure    pure bf16 (plain and Kahan-summed updates, Kahan's eager and compiled) against bf16
#           mixed on GPT-2 small: speed and peak memory.
# Compiling is most of what a cold process pays, so the call starts with `warm`: every timed
# run's compilation done once at a small size (the same model, batch and precision: the same
# graphs), several at a time beside the GPU tests, which time nothing. The timed runs after it
# find their graphs in the shared compile cache (TORCHINDUCTOR_CACHE_DIR) and one at a time
# have the machine to themselves.
#
#   scripts/gpu_proof.sh [OUT_DIR]                 # default: gpu-proof/
#   PARTS="bench lm" scripts/gpu_proof.sh          # some parts only (shipped models warm tests
#                                                  # bench lm vit resnet images pure); a second call
#                                                  # names those its steps.log did not finish
#   ARCHIVE=$OUT/proof.tar.gz scripts/gpu_proof.sh # OUT_DIR tarred after every part, so that a
#                                                  # call stopped at its limit returns the rest
#   DEVICE=cpu scripts/gpu_proof.sh /tmp/p         # the check on a CPU: every part at a toy
#                                                  # size, fp8 emulated, GPU-only parts skipped
#
# The script ends inside BUDGET seconds (default 540, inside one 10-minute device call): each part
# runs under the smaller of its own limit and the time left, and a part with under 30 s left is
# skipped and named in steps.log. Every part runs under `timeout -k 10` (a compiling process may
# not stop on SIGTERM alone). Logs, JSON and run folders (without checkpoints) land in OUT_DIR;
# data, token files and the warm-up's runs in WORK (default /tmp/mpexp-proof), never returned.
#
# On a machine without hydra-core, omegaconf or wandb, prepare their wheels first as
# ../shared/device/README.md says, then start with its install line. Record what it measured in
# docs/benchmarks.md: nothing there is estimated.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-proof}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="${WORK:-/tmp/mpexp-proof}"
mkdir -p "$work"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled WANDB_SILENT=true
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/mpexp-inductor-cache}"
device="${DEVICE:-cuda}"
status=0
deadline=$((SECONDS + ${BUDGET:-540}))
parts=" ${PARTS:-shipped models warm tests bench lm vit resnet images pure} "
want() { [[ "$parts" == *" $1 "* ]]; }

archive() {  # OUT_DIR as one file where the caller asked for it, renamed into place when whole
  [ -n "${ARCHIVE:-}" ] || return 0
  tar --exclude=checkpoints --exclude=wandb -czf "$ARCHIVE.part" -C "$(dirname "$out")" \
    "$(basename "$out")" 2>/dev/null && mv "$ARCHIVE.part" "$ARCHIVE"
}
fits() {  # name, seconds: `limit` set to the part's own, cut to the time left; false, and said
  local left=$((deadline - SECONDS))  # in steps.log, when under 30 s are left
  if [ "$left" -lt 30 ]; then
    echo "== $1: skipped, ${left} s of BUDGET left" | tee -a "$out/steps.log"
    status=1
    return 1
  fi
  limit=$(($2 < left ? $2 : left))
}
step() {  # name, seconds, command...: run one part, keep its output, go on even if it fails
  local name="$1"
  fits "$1" "$2" || return 0
  shift 2
  echo "== $name (limit ${limit} s): $*" | tee -a "$out/steps.log"
  local began=$SECONDS
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - began)) s" | tee -a "$out/steps.log"
  [ "$rc" -eq 0 ] || status=1
  tail -n 12 "$out/$name.log"
  archive
}
background=()
job() {  # name, seconds, command...: as step, in the background; `settle` waits for them all
  local name="$1"
  fits "$1" "$2" || return 0
  shift 2
  echo "== $name (in the background, limit ${limit} s): $*" | tee -a "$out/steps.log"
  (
    began=$SECONDS
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    echo "   $name: exit $? after $((SECONDS - began)) s" >>"$out/steps.log"
  ) &
  background+=($!)
}
settle() {
  [ "${#background[@]}" -eq 0 ] || wait "${background[@]}"
  background=()
  grep -h "exit" "$out/steps.log" | tail -n 20
  archive
}
chain() {  # commands separated by a lone ";;", one after another, as one background job
  local script="" word
  for word in "$@"; do
    if [ "$word" = ";;" ]; then script+="; "; else script+="$(printf '%q ' "$word")"; fi
  done
  echo "$script"
}

# What each part runs; on a CPU (DEVICE=cpu) the same commands at a toy size
mnist="$work/mnist"  # MNIST-format files of 60,000 learnable samples, as bench.py writes them
tokens="$work/tokens"  # the standard library's bytes as uint16 token files, as bench_lm.py writes
images="$work/images"
bench=(python3 scripts/bench.py --bare --no-tutorial --precisions fp16,bf16 --data-root "$mnist")
vocab=50257  # GPT-2's: the embedding and the logits at their real size
[ "$device" = cpu ] && vocab=256
lm=(python3 scripts/bench_lm.py --device "$device" --dataset tokens --tokens-dir "$tokens"
  --vocab-size "$vocab" --model gpt2_small --batch-size 16 --repeats 1)
train=(python3 -m mpexp.train "trainer.device=$device" wandb.mode=disabled trainer.progress=false)
pure=("${train[@]}" model=gpt2_small dataset=tokens "dataset.path=$tokens"
  "dataset.vocab_size=$vocab" dataset.batch_size=16 optimizer=adamw trainer.epochs=null
  trainer.eval_every_steps=30)
shipped=("${train[@]}" experiment=gpt2_small "dataset.path=$tokens" "dataset.vocab_size=$vocab"
  trainer.max_steps=30 trainer.eval_every_steps=10 scheduler.warmup_steps=10)  # 700: past its end
shipped_modes=(bf16 fp16 fp8 bf16_pure_kahan)
vit=("${train[@]}" experiment=fp8_vit trainer.seed=0 dataset.train_size=25000
  dataset.val_size=5000)
resnet=("${train[@]}" experiment=cifar10_resnet dataset=synthetic_cifar10 dataset.train_size=25000)
folder=("${train[@]}" dataset=image_folder "dataset.path=$images" model=resnet18 precision=bf16
  dataset.batch_size=64 dataset.num_workers=8 "dataset.cache_dir=$work/image-cache")
# the models part: a Llama of about 1 B parameters from its config, LoRA over a pretrained one
# of 8 such layers (written first by save_pretrained), timm's ConvNeXt-T and ViT-S at 224 px
llama=("${train[@]}" model=hf_llama_1b dataset=tokens "dataset.path=$tokens"
  "dataset.vocab_size=$vocab" dataset.batch_size=8 optimizer=adamw trainer.epochs=null
  trainer.max_steps=20 trainer.eval_every_steps=20 dataset.val_size=64)
pretrained="$work/llama-pretrained"
llama_layers=8
lora=("${train[@]}" experiment=finetune_lora "model.pretrained=$pretrained" dataset=tokens
  "dataset.path=$tokens" "dataset.vocab_size=$vocab" dataset.block_size=1024 trainer.epochs=null
  trainer.max_steps=20 trainer.eval_every_steps=20 dataset.val_size=64 trainer.plan=true
  scheduler.warmup_steps=2)
timm_sizes=(dataset.channels=3 dataset.height=224 dataset.width=224 dataset.num_classes=1000
  dataset.train_size=3840 dataset.val_size=256 dataset.batch_size=128 trainer.epochs=2)
timm=("${train[@]}" model=timm dataset=synthetic optimizer=adamw)
timm_names=(convnext_tiny vit_small_patch16_224)
small_lm=()
if [ "$device" = cpu ]; then
  llama+=(model=hf_llama_tiny dataset.batch_size=4 trainer.max_steps=4 trainer.eval_every_steps=4
    dataset.val_size=8)
  llama_layers=2
  lora+=(dataset.block_size=32 dataset.batch_size=4 trainer.max_steps=4 trainer.eval_every_steps=4
    dataset.val_size=8 scheduler.warmup_steps=1)
  timm_sizes=(dataset.channels=3 dataset.height=32 dataset.width=32 dataset.num_classes=16
    dataset.train_size=64 dataset.val_size=32 dataset.batch_size=32 trainer.epochs=1)
  timm_names=(convnext_tiny vit_tiny_patch16_224)  # convnext_atto's MLPs are convolutions
  bench+=(--device cpu --train-size 512 --process-repeats 0)
  small_lm=(--model gpt --batch-size 4)
  pure+=(model=gpt dataset.batch_size=4 trainer.eval_every_steps=2)
  # the same path at a toy size: accumulation, validation in micro-batches, the run's own plan
  shipped+=(model=gpt dataset.batch_size=8 trainer.accumulate=2 trainer.max_steps=4
    trainer.eval_every_steps=2 dataset.val_size=16 trainer.plan=true scheduler.warmup_steps=1)
  vit+=(model=vit dataset.train_size=512 dataset.val_size=64 trainer.compile=false
    scheduler.warmup_steps=2)
  resnet+=(dataset.train_size=256 dataset.val_size=64)
  folder+=(model=simplecnn_small dataset.num_workers=1 dataset.image_size=32)
fi
lm_sizes=(--train-size 1024 --epochs 3)
pure_steps=60
[ "$device" = cpu ] && lm_sizes=(--train-size 16 --epochs 2) && pure_steps=4
# -v: each test's outcome as it ends, kept in the log should the part be stopped at its limit
tests=(python3 -m pytest -m gpu -v -p no:cacheprovider --durations=15)
# three workers where pytest-xdist is installed (the GPU machine's image has it), each test
# stopped after 180 s where pytest-timeout is
python3 -c "import xdist" 2>/dev/null && tests+=(-n 3)
python3 -c "import pytest_timeout" 2>/dev/null && tests+=(--timeout=180)
vit_runs=("bf16:precision=bf16" "fp8-tensorwise:precision=fp8"
  "fp8-rowwise:precision=fp8 precision.fp8.recipe=rowwise")

step machine 30 bash -c 'nvidia-smi; python3 -c "import torch; print(torch.__version__, \
  torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(), \
  torch.cuda.is_available() and torch.cuda.get_device_capability())"; nproc; free -g'
step data 60 python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path
from argparse import Namespace
from bench import write_data
from bench_lm import write_token_files
write_data(Path('$mnist'), 60000 if '$device' == 'cuda' else 512)
write_token_files(Namespace(cache_dir='$work/text-cache'), Path('$tokens'))"

if want shipped; then  # first: what matters most, each run compiling for itself
  for p in "${shipped_modes[@]}"; do
    step "shipped-$p" 150 "${shipped[@]}" precision="$p" "hydra.run.dir=$out/shipped/$p"
  done
  step shipped-report 60 python3 -m mpexp.report "$out/shipped" --wandb disabled --no-plots
fi

if want models; then  # second: the models of the models issue, each compiling for itself
  for p in bf16 fp8; do
    step "models-llama-$p" 150 "${llama[@]}" precision="$p" "hydra.run.dir=$out/models/llama-$p"
  done
  step models-pretrained 90 python3 -c "import torch, transformers
config = transformers.LlamaConfig(vocab_size=$vocab, hidden_size=2048 if '$device' == 'cuda' else 64,
    num_hidden_layers=$llama_layers, num_attention_heads=32 if '$device' == 'cuda' else 4,
    num_key_value_heads=8 if '$device' == 'cuda' else 2,
    intermediate_size=8192 if '$device' == 'cuda' else 128, tie_word_embeddings=True,
    max_position_embeddings=2048)
with torch.device('$device'):
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained('$pretrained')
print(sum(p.numel() for p in model.parameters()), 'parameters written to $pretrained')"
  step models-lora-bf16 150 "${lora[@]}" precision=bf16 "hydra.run.dir=$out/models/lora-bf16"
  for name in "${timm_names[@]}"; do
    for p in bf16 fp8; do
      step "models-$name-$p" 120 "${timm[@]}" "model.name=$name" "${timm_sizes[@]}" \
        precision="$p" "hydra.run.dir=$out/models/$name-$p"
    done
  done
  step models-json 30 python3 -c "import json, pathlib
keys = ('status', 'perf/tokens_per_s', 'perf/samples_per_s', 'perf/mfu', 'perf/tflops',
        'perf/epoch_time_s', 'mem/peak_allocated_mib', 'mem/peak_reserved_mib',
        'mem/planned_peak_mib', 'mem/plan_error', 'val/loss', 'val/acc')
rows = {}
for summary in sorted(pathlib.Path('$out/models').glob('*/summary.json')):
    values = json.loads(summary.read_text())
    ran = values.get('ran', {})
    rows[summary.parent.name] = {**{k: values[k] for k in keys if k in values},
        **{k: ran.get(k) for k in ('precision', 'parameters', 'trainable_parameters', 'step_path',
                                   'device_name', 'peak_tflops')},
        'plan_need_mib': (ran.get('plan') or {}).get('need_bytes', 0) / 2**20 or None}
pathlib.Path('$out/models.json').write_text(json.dumps(rows, indent=1))
print(json.dumps(rows, indent=1))"
fi

if want warm; then  # compile everything timed below, several at a time; nothing here is timed
  export TORCHINDUCTOR_COMPILE_THREADS=4  # not part of a compiled graph's cache key
  lm_warm=("${lm[@]}" --train-size 32 --epochs 2 "${small_lm[@]}")
  want bench && job warm-bench 220 "${bench[@]}" --epochs 1
  # GPT-2 small at batch 16 held up to 30 GiB in one process (2026-11-26, H100): one run of
  # it at a time in each of the two chains below (three at once ran the GPU out of memory)
  if want lm; then
    job warm-lm 220 bash -c "$(chain "${lm_warm[@]}" --precisions bf16 ";;" "${lm_warm[@]}" \
      --precisions fp16,fp8 --no-plain)"
  fi
  if want pure; then
    job warm-pure 220 bash -c "$(chain "${pure[@]}" precision=bf16_pure trainer.max_steps=2 \
      trainer.eval_every_steps=2 "hydra.run.dir=$work/warm-pure-a" ";;" "${pure[@]}" \
      precision=bf16_pure_kahan trainer.max_steps=2 trainer.eval_every_steps=2 \
      "hydra.run.dir=$work/warm-pure-b" ";;" "${pure[@]}" precision=bf16_pure_kahan \
      precision.update_compile=true trainer.max_steps=2 trainer.eval_every_steps=2 \
      "hydra.run.dir=$work/warm-pure-c")"
  fi
  # ten steps each (no learning-rate warm-up to outlast), at the timed runs' batch
  short=(trainer.epochs=1 dataset.train_size=2560 scheduler.warmup_steps=2)
  [ "$device" = cpu ] && short=(trainer.epochs=1 dataset.train_size=512 scheduler.warmup_steps=0)
  if want vit; then
    job warm-vit-a 220 bash -c "$(chain "${vit[@]}" precision=bf16 "${short[@]}" \
      "hydra.run.dir=$work/warm-vit-bf16" ";;" "${vit[@]}" precision=fp8 \
      precision.fp8.recipe=rowwise "${short[@]}" "hydra.run.dir=$work/warm-vit-rowwise")"
    job warm-vit-b 220 "${vit[@]}" precision=fp8 "${short[@]}" \
      "hydra.run.dir=$work/warm-vit-tensorwise"
  fi
  if want resnet; then
    job warm-resnet 220 bash -c "$(chain "${resnet[@]}" precision=fp32 "${short[@]}" \
      "hydra.run.dir=$work/warm-resnet-fp32" ";;" "${resnet[@]}" precision=bf16 "${short[@]}" \
      "hydra.run.dir=$work/warm-resnet-bf16")"
  fi
  want tests && job gpu-tests 220 "${tests[@]}"
  settle
  unset TORCHINDUCTOR_COMPILE_THREADS
elif want tests; then
  step gpu-tests 300 "${tests[@]}"
fi

graph=true
[ "$device" = cpu ] && graph=false
if want bench; then
  step bench-default 150 "${bench[@]}" --epochs 3 --expect-cuda-graph "$graph" \
    --json "$out/bench-default.json"
  step bench-eager 120 "${bench[@]}" --epochs 2 --expect-cuda-graph false \
    --json "$out/bench-eager.json" trainer.eager=true
fi
if want lm; then
  step lm-bf16 120 "${lm[@]}" "${lm_sizes[@]}" "${small_lm[@]}" --precisions bf16 \
    --json "$out/lm-bf16.json" optimizer=adamw optimizer.lr=6e-4
  step lm-fp16-fp8 120 "${lm[@]}" "${lm_sizes[@]}" "${small_lm[@]}" --precisions fp16,fp8 \
    --no-plain --json "$out/lm-fp16-fp8.json" optimizer=adamw optimizer.lr=6e-4
fi
if want vit; then
  for spec in "${vit_runs[@]}"; do
    name="${spec%%:*}"
    read -ra how <<<"${spec#*:}"
    step "vit-$name" 90 "${vit[@]}" "${how[@]}" trainer.epochs=3 "hydra.run.dir=$out/vit/$name"
  done
  step vit-report 60 python3 -m mpexp.report "$out/vit" --wandb disabled
fi
if want resnet; then
  for p in fp32 bf16; do
    step "resnet-$p" 90 "${resnet[@]}" precision="$p" trainer.epochs=3 \
      "hydra.run.dir=$out/resnet/$p"
  done
fi
if want images; then
  tiny=()
  [ "$device" = cpu ] && tiny=(--tiny)
  step images-paths 120 python3 scripts/data_bench.py paths --workers 4 8 --repeats 2 \
    --step resnet18 --step-batch 128 --dir "$images" "${tiny[@]}"
  for how in workers:dataset.decode=cpu cache:dataset.cache=resized gpu:dataset.decode=gpu; do
    if [ "$device" = cpu ] && [ "${how%%:*}" = gpu ]; then
      echo "== images-gpu: skipped, GPU decoding needs CUDA" | tee -a "$out/steps.log"
      continue
    fi
    step "images-${how%%:*}" 90 "${folder[@]}" trainer.epochs=4 "${how#*:}" \
      "hydra.run.dir=$out/images/${how%%:*}"
  done
fi
if want pure; then
  for p in bf16 bf16_pure bf16_pure_kahan; do
    step "pure-$p" 90 "${pure[@]}" precision="$p" "trainer.max_steps=$pure_steps" \
      "hydra.run.dir=$out/pure/$p"
  done
  # Kahan's update as one compiled loop (precision.update_compile), measured on a GPU only here
  step pure-bf16_pure_kahan_compiled 90 "${pure[@]}" precision=bf16_pure_kahan \
    precision.update_compile=true "trainer.max_steps=$pure_steps" \
    "hydra.run.dir=$out/pure/bf16_pure_kahan_compiled"
fi
find "$out" -name checkpoints -type d -prune -exec rm -rf {} +
archive
echo "results in $out/ (steps.log lists each part's exit status and time)"
exit "$status"
