"""`mpexp-plan`: a run's memory and compute at its real size, before it runs, on fake tensors.

- live_bytes.py: a dispatch mode that follows every storage, its peak and what is live then;
- rehearsal.py: a configuration's run built as mpexp-train builds it, one step rehearsed;
- rows.py: configurations composed and judged against the device's memory, with advice;
- table.py, __main__.py: the command (`python -m mpexp.plan`) and what it prints.
"""
