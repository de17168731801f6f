"""Tasks: what a batch means. One object per task tells the loop, the evaluation, the FLOP count,
the tracker and the report how a batch becomes a loss, what validation measures and which metric
is the run's result (mpexp/tasks/base.py); a dataset says which task it serves."""
