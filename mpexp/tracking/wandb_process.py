"""W&B in a process of its own, fed by the training process.

wandb's import and `wandb.init` are over a second of Python work (about 1.3 s of CPU on the 2-core
machine of docs/benchmarks.md). In a thread of the training process they held the interpreter's
lock against the run's start-up and first epoch: the quickstart took 1.30x a bare script with W&B
offline, against 1.12x with W&B disabled. In a process of their own they run on another core
while the training process imports TorchDynamo and builds its optimizer, work that keeps one core
busy.

The training process (`WandbProcess`) writes messages to this process's stdin, a JSON line
`[kind, payload]` each, in order: `init` first, then any of `log`, `metrics` (more metric
definitions), `config`, `tags`, `summary`, `artifact` and `line` (a log line, for the W&B run's
Logs tab), and `finish` last. This process answers the same way on its stdout: `started` (with
the W&B run's directory) or `failed`, any `warning`, `took` (a checkpoint is copied) and
`finished`. Input that ends without `finish` (the training process was killed) finishes the W&B
run as failed, so that what was logged is kept.

The file imports only the standard library (and wandb, once asked to start) and runs by its path,
so that it starts wherever the training process runs: installed, from a checkout, or from a script
that put mpexp on sys.path. Messages are JSON, not pickles: a value that is not plain data (torch's
version string is a class of torch's) arrives as text instead of importing torch here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

Message = tuple[str, Any]
_END = None  # queued after `finish`: the writer closes this process's input

# Run as a script, not as `-m mpexp.tracking.wandb_process`: the package need not be on the
# child's path.
_RUN_BY_PATH = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


class WandbProcess:
    """The training process's end of the W&B process.

    `send` only queues a message: a thread writes the queue to the process, so that neither a W&B
    start that is slow (a far server, wandb.init_timeout) nor a full pipe holds up a training step.
    Another thread reads the answers and hands each problem to `on_problem(kind, text)` as it
    arrives (`failed`: W&B did not start; `warning`: it did not take something).
    """

    def __init__(
        self, start: dict[str, Any], log_file: Path, on_problem: Callable[[str, str], None]
    ):
        self.log_file = log_file  # the process's stderr: wandb's own errors, if any
        self.run_dir: Path | None = None  # the W&B run's directory, once it has started
        self._on_problem = on_problem
        self._ended = threading.Event()  # the W&B run finished, or never started
        self._took = threading.Event()  # the W&B process has taken a message sent_and_waited
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("ab") as stderr:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _RUN_BY_PATH, __file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                # out of the terminal's process group: Ctrl-C asks the training process to stop
                # at a checkpoint; this process ends when that one has said all it has to say
                start_new_session=True,
                env={**os.environ, "WANDB_SILENT": os.environ.get("WANDB_SILENT", "true")},
            )
        self._outbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._outbox.put(("init", start))
        self._writer = threading.Thread(target=self._write, name="wandb-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="wandb-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    def send(self, kind: str, payload: Any = None) -> None:
        if not self._ended.is_set():  # once W&B is gone, nothing is kept for it
            self._outbox.put((kind, payload))

    def send_and_wait(self, kind: str, payload: Any = None) -> None:
        """Send, and wait until the W&B process has taken it (or has ended): for a checkpoint,
        which W&B must copy before the run may delete it as it keeps only the newest."""
        self._took.clear()
        self.send(kind, payload)
        while not (self._took.wait(0.1) or self._ended.is_set()):
            pass

    def finish(self, exit_code: int, wait: bool = True) -> Path | None:
        """Finish the W&B run; the W&B run's directory, or None where W&B never started.

        Waits until the run is finished, not for the process to exit: its exit (wandb's own
        teardown) overlaps this process's. Without `wait`, the W&B process finishes the run on
        its own, in the background, and None is returned.
        """
        self.send("finish", exit_code)
        self._outbox.put(_END)
        if not wait:
            return None
        self._ended.wait()
        return self.run_dir

    def _write(self) -> None:
        pipe = self._process.stdin
        while (message := self._outbox.get()) is not _END:
            if pipe.closed:
                continue  # the process has ended: the reader says why; the queue is emptied
            try:
                line = _line(message)
            except (TypeError, ValueError) as err:  # a key JSON cannot take, say
                self._problem("warning", f"W&B did not take a {message[0]} message ({err}).")
                continue
            try:
                pipe.write(line)
                pipe.flush()
            except OSError:
                with contextlib.suppress(OSError):
                    pipe.close()
        with contextlib.suppress(OSError):
            pipe.close()

    def _read(self) -> None:
        try:
            for kind, payload in _messages(self._process.stdout):
                if kind == "started":
                    self.run_dir = Path(payload)
                elif kind == "took":
                    self._took.set()
                if kind in ("failed", "warning"):
                    self._problem(kind, payload)
                if kind in ("failed", "finished"):
                    # after the problem is told: a run that waits on this ends after the warning
                    self._ended.set()
            code = self._process.wait()  # reaped here, as it exits after its last answer
            if not self._ended.is_set():  # it died without a word: a crash, or a kill
                self._problem(
                    "warning",
                    f"W&B's process ended early (exit code {code}); its errors are in "
                    f"{self.log_file}. Local metrics continue.",
                )
        finally:  # whatever happened here, nothing in training may wait on W&B any longer
            self._ended.set()

    def _problem(self, kind: str, text: str) -> None:
        try:
            self._on_problem(kind, text)
        except Exception:  # a warning that cannot be given must not stop the threads
            logging.getLogger(__name__).exception("W&B problem not reported: %s", text)


def _line(message: Message) -> bytes:
    return (json.dumps(message, default=str) + "\n").encode()


def _messages(pipe: BinaryIO) -> Iterator[Message]:
    """The `[kind, payload]` messages on `pipe` until it ends; a line that is not one is skipped."""
    try:
        for line in pipe:
            try:
                kind, payload = json.loads(line)
            except (ValueError, TypeError):
                continue
            yield kind, payload
    except OSError:
        return


# --- the W&B process itself ------------------------------------------------------------------


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def serve(inbox: BinaryIO, answer: Callable[[str, Any], None]) -> None:
    """Start the W&B run that the first message asks for and carry out the rest in order."""
    messages = _messages(inbox)
    kind, start = next(messages, (None, None))
    if kind != "init":
        return
    try:
        import wandb

        sys.argv = start["argv"]  # W&B records the training command, not this process's
        run = wandb.init(**start["init"], settings=wandb.Settings(**start["settings"]))
        for name, options in start["metrics"]:
            run.define_metric(name, **options)
    except Exception as err:  # W&B must never stop a training run
        answer("failed", str(err).strip() or type(err).__name__)  # all of it: it may hold a hint
        return
    answer("started", str(Path(run.dir).parent))

    exit_code = 1  # unless the training process says otherwise
    taking = True  # until W&B fails to take a row: then the rest of the rows would be gaps
    for kind, payload in messages:
        if kind == "finish":
            exit_code = payload
            break
        if taking:
            try:
                _carry_out(wandb, run, kind, payload)
            except Exception as err:
                answer("warning", _not_taken(kind, payload, err))
                taking = kind != "log"
        if kind == "artifact":
            answer("took")  # taken or not: the training process may delete the file now
    try:
        run.finish(exit_code=exit_code)
    except Exception as err:
        answer("warning", f"W&B did not finish cleanly ({_first_line(err)}).")
    answer("finished")


def _carry_out(wandb: Any, run: Any, kind: str, payload: Any) -> None:
    if kind == "log":
        row, histograms = payload
        row.update({key: wandb.Histogram(np_histogram=(counts, edges))
                    for key, (counts, edges) in histograms.items()})  # fmt: skip
        run.log(row)
    elif kind == "metrics":
        for name, options in payload:
            run.define_metric(name, **options)
    elif kind == "line":
        print(payload, flush=True)  # to nowhere but W&B's capture of this console
    elif kind == "config":
        run.config.update(payload, allow_val_change=True)
    elif kind == "tags":
        run.tags = tuple(payload)
    elif kind == "summary":
        run.summary.update(payload)
    elif kind == "table":
        key, columns, rows = payload
        run.log({key: wandb.Table(columns=columns, data=rows)})
    elif kind == "artifact":
        path, metadata, aliases = payload
        artifact = wandb.Artifact(f"checkpoint-{run.id}", type="model", metadata=metadata)
        artifact.add_file(path)  # copied now: the run may delete its older checkpoints
        run.log_artifact(artifact, aliases=aliases)


def _not_taken(kind: str, payload: Any, err: BaseException) -> str:
    if kind == "artifact":
        return f"W&B did not take the checkpoint {payload[0]} ({_first_line(err)})."
    if kind == "log":
        return f"W&B stopped accepting data ({_first_line(err)}); local metrics continue."
    return f"W&B did not take the run's {kind} ({_first_line(err)})."


def main() -> None:
    # This process ends when the training process's input ends, not on a signal meant for that
    # one: a scheduler's SIGTERM to every process of a job must leave the W&B run to be finished.
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    # whatever else writes to stdout (forwarded log lines, wandb) goes to W&B's console capture
    # only, never into the answers
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())

    def answer(kind: str, payload: Any = None) -> None:
        with contextlib.suppress(OSError):  # a training process that was killed hears nothing
            answers.write(_line((kind, payload)))
            answers.flush()

    serve(sys.stdin.buffer, answer)


class LogLines(logging.Handler):
    """The training process's log records, as its console shows them, to the W&B run's Logs tab."""

    def __init__(self, process: WandbProcess):
        super().__init__(logging.INFO)
        self.process = process
        shown = [h.formatter for h in logging.getLogger().handlers if h.formatter]
        self.setFormatter(shown[0] if shown else logging.Formatter("[%(name)s] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.process.send("line", self.format(record))
        except Exception:
            self.handleError(record)


if __name__ == "__main__":
    main()
