"""Stop signals: SIGTERM (a scheduler's pre-emption), Ctrl-C, and submitit's pre-emption signal in
a SLURM job. They only set a flag; the training loop checks it once per step and stops at the step
boundary with a checkpoint. Nothing here needs torch, so the command line imports it at once.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class Preempted(BaseException):
    """Training stopped on a signal after writing a checkpoint.

    A BaseException, like KeyboardInterrupt, so that a sweep stops instead of starting its next job.
    """

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


def preemption_signal() -> int | None:
    """The signal a SLURM job started through submitit gets before it is pre-empted or reaches its
    time limit (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise); None outside submitit."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return getattr(signal, f"SIG{name.removeprefix('SIG')}", signal.SIGUSR2)


class StopSignals:
    """While active, SIGTERM and Ctrl-C (SIGINT) ask the training loop to stop at a step boundary;
    so does submitit's pre-emption signal in a SLURM job (see `preemption_signal`).

    The handler only records the signal; the loop reads `received` once per step, which costs no
    device synchronisation. A second signal stops at once, without a checkpoint. On leaving, the
    handlers that were there before come back: for the pre-emption signal that is submitit's,
    which requeues the job once the checkpoint is written (mpexp.train raises the signal again).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        preempt = preemption_signal()
        self.signals = (*self.SIGNALS, preempt) if preempt is not None else self.SIGNALS

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> StopSignals:
        global _active
        # Python allows signal handlers only in the main thread; elsewhere signals keep their
        # default effect.
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        self._outer, _active = _active, self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        _active = self._outer

    @staticmethod
    def active() -> StopSignals | None:
        """The StopSignals entered in this process, if any: the command line's, which catches
        signals from its start. A module global, not something handed down, so that a job that a
        launcher (submitit) runs in a process of its own sets up its own."""
        return _active


_active: StopSignals | None = None
