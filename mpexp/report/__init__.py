"""The sweep report: what each precision bought, read from the runs' local files.

runs.py      finds run directories and reads what each run wrote
row.py       one finished run's numbers (`Row`), and as plain values
overrides.py a job's overrides: the key each sets, those that make no configuration of their own
stats.py     means, differences and ratios with 95 % intervals (Student's t, Welch)
seed_group.py  the runs that differ only in the seed: means over seeds with 95 % intervals
configuration.py  a configuration compared with its fp32 reference (fp8 also with bf16): parity
             verdicts, speedups, time to target, its values for the tables
grouping.py  runs grouped into configurations (all but the seed alike); each one's references
table.py     the report's numbers (`Report`), read from the runs' folders; its timing warnings
axes.py      the keys a sweep varied beside the precision: the x-axis, panels and curves of its
             result, and up to which value each precision keeps fp32's result
sensitivity.py  the LR sensitivity of Wortsman et al. (2023) of a curve over learning rates
bottom_line.py  the answer per configuration: use it, don't, or undecided (power.py: the seeds
             that would decide it; more_seeds.py: the command that adds them)
markdown.py  report.md: its sections in order
sections/    report.md's sections, a module each (bottom line, warnings, parity, sweep, fp8, state,
             speed, runs, plots) and the cells they are made of
plots.py     the PNG plots
wandb_run.py the report as a W&B run in the sweep's group
wandb_view.py the sweep's W&B view: its spec (wandb-view.json), saved with wandb-workspaces
wandb_view_process.py  the view saved by a process of its own, killed at its deadline
cli.py       `python -m mpexp.report` / `mpexp-report`
callback.py  the Hydra callback that writes the report when a multirun ends
"""
