"""The whole training step as one CUDA graph, captured once and replayed every step.

An eager step on a fast GPU waits for its host: every operator is a kernel launch of some
microseconds, and a DeepCNN step in fp16 launches hundreds of them (the forward and backward
passes, the loss scaler's unscale, non-finite check and update, the optimizer, the skipped-step
rollback of BatchNorm buffers, the step's history row). Captured, the step is one launch.

What the graph holds is the Stepper's device work, all of it: it reads the batch from two static
tensors (the data gathers each batch into them) and writes everything it produces into tensors
that live as long as the graph: the weights, the optimizer's and scaler's state, the gradients,
and the step's row in the history's device ring. Nothing in it reads a value on the host, and
nothing outside it depends on Python state that the capture would freeze.

The first steps run eagerly (`WARMUP_STEPS`): they compile the model, let cuDNN pick its
algorithms and create the optimizer's state. A step that cannot be replayed (one whose
diagnostics read the gradients, a calibrating scaler's measuring steps, a batch of another
shape) runs eagerly in between, as the same code. A capture that fails leaves the run eager,
with one warning.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable

import torch

from mpexp.errors import reason
from mpexp.precision.pure_updates import GRAPH_GENERATORS

log = logging.getLogger("mpexp")

# eager steps before the capture: the first compiles (forward, then backward), the second and
# third run what compilation and cuDNN autotuning settled on, as PyTorch's graph recipe does
WARMUP_STEPS = 3

Body = Callable[[torch.Tensor, torch.Tensor], None]


class CudaGraph:
    """torch.cuda.CUDAGraph behind the two calls the step needs."""

    def __init__(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        # a generator of its own (pure bf16's stochastic rounding) must advance with each
        # replay, as the default one does; torch older than 2.5 cannot, and such a step is not
        # captured (mpexp.step.performance)
        for generator in GRAPH_GENERATORS:
            self._graph.register_generator_state(generator)

    _side: torch.cuda.Stream | None = None  # the warm-up steps' stream, one for the process

    def capture(self, body: Callable[[], None]) -> None:
        """Record `body`'s kernels; none of them runs until `replay`.

        A capture that fails raises the body's own error (not the "previous error during
        capture" that ending an invalidated capture reports), and leaves the caller on the stream
        it was on: torch.cuda.graph ends the capture before it leaves its stream, so an error
        there would otherwise leave every later step on the capture stream."""
        stream = torch.cuda.current_stream()
        failure: list[BaseException] = []

        def recorded() -> None:
            try:
                body()
            except Exception as err:
                failure.append(err)
                raise

        try:
            # thread-local: the data's own threads (token windows gathered and pinned a batch
            # ahead, a DataLoader's pin-memory thread) go on allocating pinned memory and querying
            # its events meanwhile, which a process-wide capture counts as an error in the
            # capture, failing it; none of their work touches the captured stream
            with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
                recorded()
        except Exception as err:
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize()
            raise (failure[0] if failure else err) from None

    def replay(self) -> None:
        self._graph.replay()

    @classmethod
    def warmup_stream(cls) -> contextlib.AbstractContextManager:
        """Where warm-up steps run: a side stream, as PyTorch's capture recipe does, so that
        what they initialise lazily is set up as the capture (also on a side stream) finds it.
        One stream for all of them: the allocator caches freed memory per stream."""
        if cls._side is None:
            cls._side = torch.cuda.Stream()
        cls._side.wait_stream(torch.cuda.current_stream())
        return _on_stream(cls._side)


@contextlib.contextmanager
def _on_stream(side: torch.cuda.Stream):
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


class StepGraph:
    """Runs the step's device work as a replayed graph once that can pay, and says when not.

    `run(inputs, targets)` returns True when it ran the step (captured and replayed), False when
    the caller must run the step eagerly (a warm-up step, an uncapturable batch, a failed capture).
    """

    def __init__(
        self,
        body: Body,
        on_fail: Callable[[], None],
        before_replay: Callable[[], None],
        new_graph: Callable[[], CudaGraph] = CudaGraph,
        warmup: int = WARMUP_STEPS,
    ):
        """`body` is the step's device work on a batch; `on_fail` undoes what a failed capture
        left on the host side (the scaler's and optimizer's per-step state, gradients);
        `before_replay` sets up what a replay reads from outside (the history's position)."""
        self._body, self._on_fail, self._new_graph = body, on_fail, new_graph
        self._before_replay = before_replay
        self.warmup_left = warmup
        self.graph: CudaGraph | None = None
        self.failed = False
        self.failure: str | None = None  # why the capture failed, when it did
        self.replays = 0
        self.capture_s = 0.0
        self._static: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def warmup_stream(self) -> contextlib.AbstractContextManager:
        """The context a warm-up step runs in (see CudaGraph.warmup_stream)."""
        factory = getattr(self._new_graph, "warmup_stream", None)
        return factory() if factory is not None else contextlib.nullcontext()

    def warmed_up(self) -> None:
        """An eager step ran: any eager step warms up what the capture will find."""
        self.warmup_left = max(0, self.warmup_left - 1)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> bool:
        if self.failed:
            return False
        if self.warmup_left:  # counted down by the eager steps (warmed_up)
            return False
        if self.graph is None:
            self._capture(inputs, targets)
            if self.graph is None:
                return False
        static_inputs, static_targets = self._static
        if inputs is not static_inputs or targets is not static_targets:
            if inputs.shape != static_inputs.shape or targets.shape != static_targets.shape:
                return False  # a last, smaller batch (drop_last=false): eagerly
            static_inputs.copy_(inputs)  # from a DataLoader: copied into the graph's input
            static_targets.copy_(targets)
        self._before_replay()
        self.graph.replay()
        self.replays += 1
        return True

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        # inputs that stay: the data's static batch if that is what came, else a copy of it
        # (the graph reads these two tensors at every replay, whatever they then hold)
        static = inputs.is_contiguous() or inputs.is_contiguous(memory_format=torch.channels_last)
        self._static = (inputs, targets) if static else (inputs.clone(), targets.clone())
        began = time.perf_counter()
        graph = self._new_graph()
        try:
            with warnings.catch_warnings():
                # a capturable optimizer warns when it steps outside a capture; here it is inside
                warnings.filterwarnings("ignore", message=".*capturable=True.*")
                graph.capture(lambda: self._body(*self._static))
        except Exception as err:  # any capture failure leaves the run eager
            self.failed = True
            self._on_fail()
            self.failure = f"the capture failed: {reason(err)}"
            log.warning(
                "The training step could not be captured as a CUDA graph (%s); the run goes on "
                "with eager steps (recorded as cuda_graph: false). trainer.cuda_graph=false "
                "skips the attempt.",
                reason(err),
            )
            return
        self.graph = graph
        self.capture_s = time.perf_counter() - began
