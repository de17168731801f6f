"""Whether a model's training step can be captured as a CUDA graph, found before the run starts.

A captured step replays its kernels without the Python around them, so a step that stops to read
a value on the host (`.item()`, `if tensor:`, `.tolist()`, `.cpu()`) or that makes a tensor whose
size depends on its values (`nonzero`, `masked_select`, boolean indexing) cannot be captured: the
first ends the capture with an error, the second would replay one size forever. Any model may do
either, a library's as well as one's own, so it is not left to the model's word
(`mpexp.step.performance.declares_capturable` speaks of Python-side state only) but looked for:
one forward and backward pass of a copy of the model on the meta device, which computes shapes
only and leaves the model's weights, its statistics and the random generators (torch's,
Python's, NumPy's) as they were,
watched operator by operator. PyTorch tags the operators it cannot run without a value
(`data_dependent_output`) or whose output's shape depends on values (`dynamic_output_shape`).

The answer is in words, for `ran.cuda_graph_off`: what the model does, where (its own module
names) and why a captured step cannot.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpexp.step.meta_copy import meta_copy
from mpexp.tasks.base import Task

HOST_READ = "reads a tensor's value on the host"
VALUE_SHAPED = "makes a tensor whose size depends on its values"
MASKED = "indexes a tensor by a boolean mask, whose count of true values is read on the host"
# indexing by tensors: static in shape with integer indices (a Swin's relative position bias),
# a host read with a boolean mask (x[mask], x[mask] = v)
INDEXING = (
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
)


class _Found(Exception):
    """Raised out of the pass at the first operator that a capture cannot take."""


class _Watch(TorchDispatchMode):
    """Stops the pass at the first operator a CUDA graph cannot capture, naming it and the
    module (by the model's own names) whose forward pass ran it."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names
        self.stack: list[str] = []  # the modules whose forward pass is running, innermost last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = None
        if func in INDEXING:  # tagged by what a mask would do; integer indices keep the shape
            if any(_is_mask(index) for index in args[1]):
                what = MASKED
        elif torch.Tag.data_dependent_output in func.tags:
            what = HOST_READ
        elif torch.Tag.dynamic_output_shape in func.tags:
            what = VALUE_SHAPED
        elif func is torch.ops.aten._to_copy.default and _to_host(args, kwargs):
            what = "copies a tensor to the host"
        if what is not None:
            where = f"in {self.stack[-1]}" if self.stack else "in its backward pass"
            raise _Found(f"{what} ({func.overloadpacket.__name__} {where})")
        return func(*args, **kwargs)

    def enter(self, module: nn.Module, *_) -> None:
        self.stack.append(self.names.get(id(module)) or "its forward pass")

    def leave(self, *_) -> None:
        self.stack.pop()


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _to_host(args, kwargs) -> bool:
    device = kwargs.get("device")
    host = device is not None and torch.device(device).type == "cpu"
    return host and args[0].device.type != "cpu"


@contextlib.contextmanager
def random_state_kept():
    """The pass draws nothing the run would: a forward that draws from Python's or NumPy's
    generators (as a model not made for capture may) leaves them where they were."""
    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def graph_blocker(model: nn.Module, task: Task) -> str | None:
    """Why `model`'s training step cannot be captured as a CUDA graph, in words; None when no
    operator of its forward and backward pass (and its task's loss) stands in the way, or when
    the meta device cannot run the model at all (then the capture itself is tried, and its
    failure recorded)."""
    try:
        meta = meta_copy(model)
    except Exception:  # a model that cannot be copied: the capture will tell
        return None
    meta.train()
    names = {id(m): name for name, m in meta.named_modules() if name}
    watch = _Watch(names)
    hooks = []
    for module in meta.modules():
        hooks.append(module.register_forward_pre_hook(watch.enter))
        hooks.append(module.register_forward_hook(watch.leave, always_call=True))
    inputs, targets = task.example(2, "meta")
    try:
        with watch, random_state_kept():
            task.loss(meta(inputs), targets).backward()
    except _Found as found:
        return f"{type(model).__name__} {found}, which a captured step cannot replay"
    except Exception:  # not runnable on the meta device: nothing known either way
        return None
    finally:
        for hook in hooks:
            hook.remove()
    return None
