#!/usr/bin/env bash
# The World4AI "Mixed Precision Training" tutorial's experiment as one multirun: DeepCNN on MNIST,
# Adam lr 1e-4, batch 256, 10 epochs, fp32 against fp16 (autocast with dynamic loss scaling).
# The tutorial measured 22 s/epoch in fp32 and 13 s/epoch with AMP on its GPU.
#
#   scripts/seed_experiment.sh [more overrides...]     e.g. wandb.mode=offline trainer.device=cuda
#
# When the sweep ends, the sweep report (report.md and plots) is written into the sweep folder and
# its path printed. MNIST is downloaded to data/ when the network allows. On CPU DeepCNN takes
# hours; run it on a CUDA GPU.
set -euo pipefail

python -m mpexp.train -m \
  model=deepcnn dataset=mnist optimizer=adam optimizer.lr=1e-4 dataset.batch_size=256 \
  trainer.epochs=10 precision=fp32,fp16 loss_scaling=auto "$@"
