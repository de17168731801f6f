"""Stop signals: SIGTERM (a scheduler's pre-emption), Ctrl-C, SIGHUP (the terminal or ssh session
closed) and submitit's pre-emption signal in a SLURM job. They only set a flag; the training loop
checks it once per step and stops at the step boundary with a checkpoint. Nothing here needs
torch, nor Hydra: the command line imports it first, to catch signals from its start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
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
    """While active, SIGTERM, Ctrl-C (SIGINT) and SIGHUP ask the training loop to stop at a step
    boundary; so does submitit's pre-emption signal in a SLURM job (see `preemption_signal`).
    A SIGHUP that the process was started ignoring (`nohup`) stays ignored: the run goes on.

    The handler only records the signal; the loop reads `received` once per step, which costs no
    device synchronisation. A second signal stops at once, without a checkpoint. On leaving, the
    handlers that were there before come back: for the pre-emption signal that is submitit's,
    which requeues the job once the checkpoint is written (mpexp.train raises the signal again).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: int | None = None
        # a second signal came: its KeyboardInterrupt may reach the caller as another error
        # (torch.save turns one raised inside its writer into a RuntimeError), which this tells
        self.again = False
        # before the command line's own code runs (its imports): nothing could catch the
        # KeyboardInterrupt of a second signal, so it ends the process here (see catch_from_start)
        self.before_start = False
        self._previous: dict[int, Any] = {}
        preempt = preemption_signal()
        self.signals = (*self.SIGNALS, preempt) if preempt is not None else self.SIGNALS

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        elif self.before_start:
            sys.stderr.write(INTERRUPTED_BEFORE_START)
            raise SystemExit(128 + signal.SIGINT)
        else:
            self.again = True
            raise KeyboardInterrupt

    def __enter__(self) -> StopSignals:
        global _active
        # Python allows signal handlers only in the main thread; elsewhere signals keep their
        # default effect.
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                if signum == signal.SIGHUP and signal.getsignal(signum) is signal.SIG_IGN:
                    continue  # nohup: the user asked for the run to outlive the terminal
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


def stopped_again() -> bool:
    """Whether a second stop signal came to this process: what cut short whatever failed."""
    return _active is not None and _active.again


INTERRUPTED_BEFORE_START = "Interrupted before the run started; nothing was trained.\n"


def catch_from_start() -> StopSignals:
    """Enter the command line's StopSignals now, before its slow imports (Hydra, OmegaConf), so
    that a stop signal asks to stop from the moment the command starts; `cli` takes it over
    through `StopSignals.active()` and leaves it as the command ends."""
    stop = StopSignals().__enter__()
    stop.before_start = True
    return stop


def quiet_exit(code: int) -> None:
    """From here to the process's end, Ctrl-C ends it at once with `code`, the status it was
    ending with, and prints nothing: the run's files are written by then, and Python would print
    a traceback from whatever exit hook (torch's, W&B's, a thread's join) the KeyboardInterrupt
    landed in. For the command only: it is the process's last moment."""

    def _exit_now(signum, frame) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_now)
