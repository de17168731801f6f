"""The sweep report: what each precision bought, read from the runs' local files.

runs.py      finds run directories and reads what each run wrote
table.py     one row per run, compared with the fp32 run of the same model and dataset
markdown.py  report.md
plots.py     the PNG plots
wandb_run.py the report as a W&B run in the sweep's group
cli.py       `python -m mpexp.report` / `mpexp-report`
callback.py  the Hydra callback that writes the report when a multirun ends
"""
