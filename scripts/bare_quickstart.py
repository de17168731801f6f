"""The quickstart's training as a bare script: the yardstick for mpexp's whole-process overhead.

The same data (mpexp's synthetic set, seed 42), model (SimpleCNN at width 16), optimizer (Adam,
lr 1e-3), batch (128, drop_last), epochs (5) and per-epoch validation as
`python -m mpexp.train experiment=quickstart`, with nothing else: no config system, no metric
files, no W&B, no checkpoints. `scripts/bench.py --device cpu` times both as whole processes.

    python scripts/bare_quickstart.py [--epochs 5] [--train-size 8192]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpexp.data.synthetic import SyntheticData
from mpexp.models.simplecnn import SimpleCNN

SEED = 42


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--train-size", type=int, default=8192)
    args = parser.parse_args()
    device = torch.device("cpu")
    torch.manual_seed(SEED)
    data = SyntheticData(train_size=args.train_size, noise=0.8, seed=SEED, batch_size=128)
    info = data.setup(device)
    model = SimpleCNN(info.channels, info.num_classes, (info.height, info.width), width=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        for images, labels in data.train_batches(epoch, SEED, device):
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            correct = sum((model(x).argmax(1) == y).sum() for x, y in data.val_batches(device))
        model.train()
        print(f"epoch {epoch}: {elapsed:.2f} s, val acc {int(correct) / len(data.val[1]):.3f}")


if __name__ == "__main__":
    main()
