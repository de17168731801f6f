"""A CUDA graph's semantics on a CPU, for tests: capture records the operators a function
dispatches; replay runs those operators again on the same tensors, without the Python around them.

What a CUDA graph holds is the kernels of one call and the memory they read and write. Replaying
it repeats the kernels on that memory; the Python that issued them does not run again. So a step
is safe to capture only if everything that must change from one step to the next is in tensors
that it updates in place, and it reads no value on the host. `RecordedGraph` reproduces that with
a dispatch mode, on any device:

- capture runs the function once, recording each operator with its arguments and results, and
  then puts back every tensor that existed before the capture and that an operator wrote to, so
  that, as with CUDA, capturing trains nothing;
- replay runs the recorded operators in order: those that write into their arguments write into
  the same tensors again; those that make a new tensor have their result copied into the tensor
  that the capture made, which later operators (and the Python objects holding it) read;
- a host read (`.item()`, `float(t)`, `if t:`) during capture fails, as CUDA's capture does.

It stands for the trajectory of replayed steps, not for what a real capture accepts: `.tolist()`,
`.cpu()`, `nonzero()`, boolean-mask indexing and `torch.tensor(...)` pass its capture (CUDA's
fails on each), a CPU tensor changed after the capture is read again at replay (CUDA keeps the
value it had), and the real `CudaGraph` (its side stream, `torch.cuda.graph`, the error and the
stream put back) never runs. tests/test_gpu.py checks those on a GPU.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
# operators that update arguments their schema does not mark as written: BatchNorm in training
# updates its running statistics (arguments 3 and 4)
UNMARKED_WRITES = {torch.ops.aten.native_batch_norm.default: (3, 4)}


def _written_args(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an operator writes into (in-place and out= arguments)."""
    written = [args[i] for i in UNMARKED_WRITES.get(func, ()) if args[i] is not None]
    by_name = dict(kwargs)
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else by_name.get(arg.name)
        written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written


def _returns_alias(func) -> bool:
    """Whether the operator's results are views or its written arguments, not new tensors."""
    return any(r.alias_info is not None for r in func._schema.returns)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.made: set[int] = set()  # ids of tensors made during the capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"{func} reads a tensor value on the host inside a captured step")
        for t in _written_args(func, args, kwargs):
            if id(t) not in self.made and id(t) not in self.saved:
                self.saved[id(t)] = (t, t.clone())  # put back after the capture
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.add(id(t))
        self.ops.append((func, args, kwargs, out))
        return out


class RecordedGraph:
    """The CudaGraph interface of mpexp.step.step_graph, emulated on any device (see module doc)."""

    def __init__(self) -> None:
        self._ops: list[tuple] = []
        self.captures = 0
        self.replays = 0

    def capture(self, body) -> None:
        recorder = _Recorder()
        with recorder:
            body()
        for tensor, before in recorder.saved.values():
            with torch.no_grad():
                tensor.copy_(before)
        self._ops = recorder.ops
        self.captures += 1

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, out in self._ops:
                if _returns_alias(func) and not _written_args(func, args, kwargs):
                    continue  # a view: it already shows the memory it views
                result = func(*args, **kwargs)
                if _returns_alias(func):
                    continue  # wrote into its arguments
                for old, new in zip(tree_flatten(out)[0], tree_flatten(result)[0], strict=True):
                    if isinstance(old, torch.Tensor):
                        old.copy_(new)
        self.replays += 1
