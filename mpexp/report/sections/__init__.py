"""report.md's sections, a module each, with `section(report)` returning its lines ([] where it
has nothing to say); mpexp/report/markdown.py puts them in order.

bottom_line.py     the Bottom line: use it, don't, or undecided and the seeds that would decide
cells.py           numbers, intervals and verdicts as table cells; a Markdown table
caveats.py         Warnings: what makes the numbers less than they seem, and what to do
results.py         the result against fp32: parity verdicts
sweep.py           the result against the key swept beside the precision; LR sensitivity
fp8.py             fp8 against bf16
training_state.py  pure bf16's bytes held between steps beside its parity
speed.py           Speed: epoch times, speedups, time to target, throughput, memory
runs_table.py      Runs: a row per run
figures.py         Plots: the PNGs, and why one is missing
"""
