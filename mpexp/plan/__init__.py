"""`mpexp-plan`: a run's memory and compute at its real size, before it runs, on fake tensors.

- live_bytes.py: a dispatch mode that follows every storage, its peak and what is live then;
- rehearsal.py: a configuration's run built as mpexp-train builds it, two steps rehearsed;
- held.py: what a run holds from step to step, by kind; sharing.py: DDP's buckets, FSDP's shares;
- rows.py: configurations composed and judged against the device's memory (the need, the
  margin); advice.py: the keys that would make a row fit, each planned again;
- devices.py: devices known by name, and a step's time estimated on one;
- table.py, __main__.py: the command (`python -m mpexp.plan`) and what it prints;
- before_run.py: the plan a run makes of itself before its first step.
"""
