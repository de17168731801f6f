#!/usr/bin/env bash
# Every precision mode against every loss-scaling strategy on one model, as one multirun ending in
# the sweep report (report.md and plots in the sweep folder). fp32 without loss scaling is the
# reference each run is compared with.
#
#   scripts/precision_grid.sh [model] [more overrides...]
#   scripts/precision_grid.sh resnet18 dataset=cifar10 trainer.epochs=5
#   PRECISIONS=fp32,fp16 SCALINGS=none,dynamic scripts/precision_grid.sh simplecnn
#
# PRECISIONS and SCALINGS narrow the grid (the same key twice on Hydra's command line would not).
set -euo pipefail

model="${1:-deepcnn}"
shift $(($# > 0 ? 1 : 0))

python -m mpexp.train -m "model=${model}" \
  "precision=${PRECISIONS:-fp32,tf32,fp16,bf16}" \
  "loss_scaling=${SCALINGS:-none,static,dynamic}" "$@"
