#!/usr/bin/env bash
# The README's picture, docs/images/quickstart-sweep.png, made from the README's own sweep: the
# report's result.png (val accuracy by precision: each seed, the mean and its 95 % interval) and its
# loss_scale.png (fp16's loss scale at every step), one above the other in one small PNG. Run it again
# whenever the report's plots change look (mpexp/report/plots.py), so that the README shows what a
# sweep gives today.
#
#   scripts/readme_figure.sh              run the sweep, then draw (two CPU cores: the fp16 runs,
#                                         emulated on a CPU without float16 instructions, take most)
#   scripts/readme_figure.sh SWEEP_DIR    draw again from a sweep already run
set -euo pipefail
sweep=${1:+$(realpath "$1")}  # taken from where the command was typed, before the cd below
cd "$(dirname "$0")/.."

if [[ -z $sweep ]]; then
    sweep=outputs/multirun/readme-figure-$(date +%Y-%m-%d_%H-%M-%S)
    python -m mpexp.train -m experiment=quickstart precision=fp32,tf32,fp16,bf16 \
        trainer.seed=0,1,2 "hydra.sweep.dir=$sweep"
fi

# the report drawn again by today's code, into the sweep's folder as `mpexp-report <sweep>` does
python -m mpexp.report "$sweep" --wandb disabled >/dev/null

mkdir -p docs/images
python - "$sweep/result.png" "$sweep/loss_scale.png" docs/images/quickstart-sweep.png <<'PY'
import sys
from PIL import Image

*parts, out = sys.argv[1:]
width = 1100  # pixels: sharp where GitHub scales it down to its column, small in bytes
images = []
for path in parts:
    image = Image.open(path).convert("RGB")
    images.append(image.resize((width, round(image.height * width / image.width)), Image.LANCZOS))
picture = Image.new("RGB", (width, sum(i.height for i in images)), "white")
top = 0
for image in images:
    picture.paste(image, (0, top))
    top += image.height
# a palette of 256 colours keeps a plot's flat colours and antialiasing at a fraction of the bytes
picture.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
print(f"{out}: {picture.width}x{picture.height}")
PY
