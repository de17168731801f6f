"""Bytes that a run's tensors hold, op by op, without computing anything: a dispatch mode that
follows every storage the ops under it make, from the op that made it until Python frees it.

Run over fake tensors (`FakeTensorMode`), the ops compute shapes, dtypes and strides only, so a
GPT-2 step of 491,520 tokens is followed in seconds on a CPU. A storage is counted once however
many views share it, at its allocated size (`nbytes`), which is what PyTorch's allocators are
asked for; the CUDA caching allocator's rounding (to 512 bytes) and its fragmentation are not
counted, as `torch.cuda.max_memory_allocated` does not count them either.

torch.distributed._tools.MemTracker does the same with module-level bookkeeping, but refuses a
module's second forward while it tracks (every micro-batch after the first) and needs torch 2.5;
this one needs only storages' weak references, which PyTorch has kept since 2.0.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count


def _cpu_attention_formulas() -> dict:
    """FLOP formulas for the CPU's fused attention kernels, which torch's registry lacks: the
    rehearsal runs on CPU tensors, and a GPU's flash attention does the same products."""
    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:
        return {}

    def forward_flops(query, key, value, *args, **kwargs) -> int:
        return sdpa_flop_count(query.shape, key.shape, value.shape)

    def backward_flops(grad_out, query, key, value, *args, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)

    return {forward: forward_flops, backward: backward_flops}


# torch's formulas (matrix products, convolutions, attention), as mpexp/step/flops.py counts
FORMULAS = {**flop_registry, **_cpu_attention_formulas()}


@dataclass
class Allocation:
    """One storage: its size, what made it, and when (op counts) it was made and freed."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    # the op, the module whose forward ran it and the phase; or a name ("exp_avg of wte.weight")
    made_by: tuple | str
    born: int
    died: int | None = None  # None: still live

    @property
    def what(self) -> str:
        """ "aten.mm in transformer.h.3.mlp (train_step)", or the name it was given."""
        if isinstance(self.made_by, str):
            return self.made_by
        func, where, phase = self.made_by
        op = f"{func.__module__.rpartition('.')[2]}.{func.__name__.split('.')[0]}"
        return f"{op}{f' in {where}' if where else ''} ({phase})"

    def live_at(self, clock: int) -> bool:
        return self.born <= clock and (self.died is None or self.died > clock)

    def describe(self) -> dict:
        return {
            "bytes": self.nbytes,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "what": self.what,
        }


@dataclass
class Peak:
    nbytes: int = 0
    clock: int = 0
    base: int = 0  # what was live as its phase started


class LiveBytes(TorchDispatchMode):
    """The live bytes now, and their peak per phase (`start(phase)` names the stretch of ops that
    follows); `largest_at(phase)` names the largest storages live at that phase's peak. With
    `count_flops`, it also adds up the FLOPs of matrix products, as mpexp/step/flops.py counts."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[Allocation] = []
        self._live: dict[int, int] = {}  # id(storage) -> index into allocations
        self.now = 0
        self.clock = 0
        self.phase = "build"
        self.peaks: dict[str, Peak] = {}
        self.where = ""  # the module whose forward runs now, where the model says (see `watch`)
        self._refs: dict[int, weakref.ref] = {}
        self._stack: list[str] = []  # the modules whose forwards enclose the running one
        self.count_flops = False  # matrix products' FLOPs (torch's formulas) while on
        self.host_reads: dict[str, int] = {}  # per phase: values read on the host, taken as 0
        self.flops = 0

    # --- what the ops make ---------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            # a value read on the host (.item(), a flag in an `if`): a fake has none, so it
            # reads as 0, which a loss scaler's overflow flag means as "finite: take the step"
            self.host_reads[self.phase] = self.host_reads.get(self.phase, 0) + 1
            return False if args[0].dtype is torch.bool else 0
        self.clock += 1
        if self.count_flops:
            formula = FORMULAS.get(func._overloadpacket)
            if formula is not None:
                self.flops += formula(*args, **kwargs, out_val=out)
        if isinstance(out, torch.Tensor):
            self.adopt(out, (func, self.where, self.phase))
        else:
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self.adopt(value, (func, self.where, self.phase))
        return out

    def adopt(self, tensor: torch.Tensor, made_by: tuple | str) -> None:
        """Count `tensor`'s storage from now on, if it is not counted yet (one made before the
        mode started, say)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = len(self.allocations)
        self.allocations.append(
            Allocation(nbytes, tuple(tensor.shape), tensor.dtype, made_by, self.clock)
        )
        self.now += nbytes
        peak = self.peaks.setdefault(self.phase, Peak())
        if self.now > peak.nbytes:
            peak.nbytes, peak.clock = self.now, self.clock
        # the storage's own Python object lives exactly as long as the storage (PyTorch keeps
        # one per storage), so its weak reference says when the storage is freed
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))

    def _free(self, key: int) -> None:
        self._refs.pop(key, None)
        index = self._live.pop(key, None)
        if index is not None:
            allocation = self.allocations[index]
            # freed after op `clock` ran: live at that op's peak, gone before the next op's
            allocation.died = self.clock + 1
            self.now -= allocation.nbytes

    # --- phases and names ----------------------------------------------------------------------

    def start(self, phase: str) -> None:
        """Ops from here on belong to `phase`; its peak starts from what is live now."""
        self.phase = phase
        self.peaks[phase] = Peak(self.now, self.clock, self.now)

    def name(self, tensor: torch.Tensor, what: str) -> None:
        """Call the storage behind `tensor` `what` (a weight's, a state's name) in the lists of
        the largest tensors."""
        index = self._live.get(id(tensor.untyped_storage()))
        if index is not None:
            self.allocations[index].made_by = what

    def live_bytes(self, tensors) -> int:
        """The bytes of the distinct storages behind `tensors`."""
        seen = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
        return sum(seen.values())

    def largest_at(self, phase: str, count: int = 5) -> list[dict]:
        """The `count` largest storages live at `phase`'s peak."""
        peak = self.peaks.get(phase)
        if peak is None:
            return []
        live = [a for a in self.allocations if a.live_at(peak.clock)]
        live.sort(key=lambda a: a.nbytes, reverse=True)
        return [a.describe() for a in live[:count]]

    def watch(self, model: torch.nn.Module) -> list:
        """Name the module whose forward makes each tensor (hooks on `model`'s own modules only:
        global module hooks would fire in every thread of the process)."""
        handles = []
        for name, module in model.named_modules():

            def enter(_module, _args, name=name):
                self._stack.append(self.where)
                self.where = name or type(_module).__name__

            def leave(_module, _args, _output):
                self.where = self._stack.pop() if self._stack else ""

            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
        return handles
