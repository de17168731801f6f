#!/usr/bin/env bash
# The README's picture, docs/images/quickstart-sweep.png, made from the README's own sweep: the
# report's result.png (val accuracy by precision: each seed, the mean and its 95 % interval) and its
# loss_scale.png (fp16's loss scale at every step), side by side in one small PNG. Run it again
# whenever the report's plots change look (mpexp/report/plots.py), so that the README shows what a
# sweep gives today.
#
#   scripts/readme_figure.sh              run the sweep, then draw (two CPU cores: the fp16 runs,
#                                         emulated on a CPU without float16 instructions, take most)
#   scripts/readme_figure.sh SWEEP_DIR    draw again from a sweep already run
set -euo pipefail
cd "$(dirname "$0")/.."

sweep=${1:-}
if [[ -z $sweep ]]; then
    sweep=outputs/multirun/readme-figure-$(date +%Y-%m-%d_%H-%M-%S)
    python -m mpexp.train -m experiment=quickstart precision=fp32,tf32,fp16,bf16 \
        trainer.seed=0,1,2 "hydra.sweep.dir=$sweep"
fi

# the report drawn by today's code into a folder of its own; the sweep's own report stays as it was
drawn=$(mktemp -d)
trap 'rm -rf "$drawn"' EXIT
python -m mpexp.report "$sweep" --out "$drawn" --wandb disabled >/dev/null

mkdir -p docs/images
python - "$drawn/result.png" "$drawn/loss_scale.png" docs/images/quickstart-sweep.png <<'PY'
import sys
from PIL import Image

*parts, out = sys.argv[1:]
height = 420  # pixels: the README shows the two side by side at about this height
images = []
for path in parts:
    image = Image.open(path).convert("RGB")
    images.append(image.resize((round(image.width * height / image.height), height), Image.LANCZOS))
picture = Image.new("RGB", (sum(i.width for i in images), height), "white")
left = 0
for image in images:
    picture.paste(image, (left, 0))
    left += image.width
# a palette of 256 colours keeps a plot's flat colours and antialiasing at a fraction of the bytes
picture.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
print(f"{out}: {picture.width}x{picture.height}")
PY
