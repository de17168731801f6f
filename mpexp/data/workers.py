"""DataLoader worker processes that leave stop signals to the main process.

A scheduler's pre-emption (SLURM's, `timeout`'s) sends SIGTERM to every process of the job, and a
Ctrl-C sends SIGINT to every process of the terminal's foreground group: the loader's workers get
them too. A worker that ended on one would end the main process's next batch with a traceback
("DataLoader worker ... is killed by signal") before the run could write its checkpoint. So the
workers take no stop signal as their own: the main process answers it (mpexp/stopping.py) and ends
its workers itself, with the SIGTERM that torch and multiprocessing send a worker to end it.

The two kinds of SIGTERM are told apart by their sender, which only a signal taken with
`sigwaitinfo` shows: the signals are blocked from before the workers are forked (a worker that
got one between its start and its init function would die of it), and a thread of each worker
takes them. One sent by the main process ends the worker at once, with a success status, as
torch's own handler does; any other is left to the main process. Where `sigwaitinfo` is missing
(macOS), workers keep torch's handling.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch.utils.data import DataLoader

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_CAN_TELL_SENDERS = hasattr(signal, "sigwaitinfo")

# What waits for a thread of this process that runs native code (torch's) to end, called before
# the loaders next fork their workers. A fork copies every lock as it stands: glibc resets its
# malloc and stdio locks in the child, but not the one that `atexit` registrations take, which C++
# takes to register a static object's destructor the first time a function runs. A worker forked
# while another thread held it waits for ever in its own first such call (torch.set_num_threads,
# at the top of DataLoader's worker loop), and the run for its first batch.
_BEFORE_FORK: list[Callable[[], None]] = []


def wait_before_forking(wait: Callable[[], None]) -> None:
    """`wait()` is called before the loaders next fork workers: it returns once a thread that runs
    native code has ended (`thread.join`, `pool.shutdown`)."""
    _BEFORE_FORK.append(wait)


class WorkerLoader(DataLoader):
    """A DataLoader whose workers leave stop signals to the main process (see above)."""

    def __init__(self, *args, **kwargs) -> None:
        if _CAN_TELL_SENDERS:
            kwargs["worker_init_fn"] = _leave_stops_to_the_main_process
        super().__init__(*args, **kwargs)

    def __iter__(self):
        while self.num_workers > 0 and _BEFORE_FORK:
            _BEFORE_FORK.pop()()
        # the workers are forked here (at the first epoch only, when they are persistent), and
        # a forked process starts with its parent thread's blocked signals
        with _stop_signals_held():
            return super().__iter__()


@contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Stop signals wait, in this thread, until the block ends; one that came meanwhile is taken
    then, by the main thread's handler as usual."""
    if not _CAN_TELL_SENDERS:
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _leave_stops_to_the_main_process(worker_id: int) -> None:
    # already blocked since the fork; blocked again for a loader that another thread started
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    main_process = os.getppid()
    threading.Thread(
        target=_take_stop_signals, args=(main_process,), name="stop-signals", daemon=True
    ).start()


def _take_stop_signals(main_process: int) -> None:
    while True:
        taken = signal.sigwaitinfo(STOP_SIGNALS)
        if taken.si_signo == signal.SIGTERM and taken.si_pid == main_process:
            os._exit(0)  # the main process ends its workers: no cleanup to wait for
