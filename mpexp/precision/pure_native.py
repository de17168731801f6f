"""Pure bf16's compiled update on a CPU: mpexp/precision/pure_native.c, built with the system's C
compiler once per variant and machine, and called through ctypes.

torch.compile's C++ for the same update (mpexp/precision/pure_kernels.py) has no vector bitcast:
each of stochastic rounding's three roundings reads and writes a float32 value's bits an element
at a time, which made its step 3.5 times torch's fused AdamW on a 36.8 M MLP. The C loop is the
same arithmetic in the same order, and stores the same bits; its compiler vectorises the bit
arithmetic (docs/benchmarks.md has the step times). On a GPU, Triton has no such gap, and the
update stays torch.compile's.

A build is kept in `$MPEXP_KERNEL_DIR` (default ~/.cache/mpexp/kernels), named by a digest of
the source, the variant, the flags, the compiler's version and the CPU's features (it is built
for this CPU, -march=native), and written whole (mpexp/atomic.py), so that the processes
of a sweep or of DDP that build the same one at once each load a whole file.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from mpexp.atomic import write_whole
from mpexp.precision.pure_kernels import Variant

SOURCE = Path(__file__).with_name("pure_native.c")

# -fno-fast-math: against a compiler whose default is fast (each build's known answer checks
# it); first, as it turns errno back on; -ffp-contract=off: no fused multiply-add (the split
# and the bits must be `_update`'s); -fno-math-errno: sqrtf without errno, or the loop stays
# scalar (7 times as slow)
FLAGS = ("-fno-fast-math", "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno",
         "-shared", "-fPIC")  # fmt: skip
# the threads of a big call: libgomp, the OpenMP torch's CPU build itself loads
OPENMP = "-fopenmp"

_ROUNDINGS = {"nearest": 0, "kahan": 1, "stochastic": 2}


def compiler() -> str | None:
    """The C compiler the build uses, or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def cannot_build() -> str | None:
    """Why the native update cannot be built here, or None."""
    if compiler() is None:
        return "no C compiler (cc, gcc or clang, or $CC) on the PATH"
    if not SOURCE.is_file():
        return f"{SOURCE} is missing from the installed package"
    return None


def defines(v: Variant) -> dict[str, int]:
    """The macros that fix `v` in the C source."""
    return {
        "ADAM": int(v.algorithm == "adam"),
        "ROUNDING": _ROUNDINGS[v.rounding],
        "COUNT": int(bool(v.count)),  # (by piece, whether torch.compile's sums or masks)
        "DECOUPLED": int(v.decoupled),
        "MOMENTUM": int(v.momentum),
        "NESTEROV": int(v.nesterov),
        "DECAY": int(v.decay),
        "SCALED": int(v.scaled),
        "SIXTEEN": int(v.sixteen),
    }


class NativeUpdate:
    """A variant's built update. Called as torch.compile's `_update` is, on flat CPU tensors laid
    out densely, but for the count: with `ends` (int64, where each of the call's pieces ends;
    None: one piece), a counting variant returns each piece's (moved, changed) counts, an int64
    tensor of (pieces, 2), and writes the weights in place whatever its count (torch.compile's
    loop writes masks, or its weights elsewhere, for the caller to sum or copy)."""

    def __init__(self, variant: Variant) -> None:
        self.variant = variant
        self._function = _library(variant).pure_update
        self._function.restype = None
        pointer = ctypes.c_void_p
        self._function.argtypes = [pointer] * 8 + [ctypes.c_int, ctypes.c_int64] + [pointer] * 2
        v = variant
        state = torch.bfloat16 if v.sixteen else torch.float32
        # what each argument must be: its dtype (None: absent) and its elements (None: the
        # call's); the states', Kahan's buffer's, the coefficients', the keys', the scaling's
        self._states = (state, None)
        self._unused = torch.zeros(1, 2, dtype=torch.int64)
        self._others = (
            (torch.bfloat16 if v.rounding == "kahan" else None, None),
            (torch.float32, 7 if v.algorithm == "adam" else 5),
            (torch.int32 if v.rounding == "stochastic" else None, 4),
            (torch.float32 if v.scaled else None, 2),
        )

    def __call__(self, w, g, states, carried, coefficients, keys, scaling, ends=None):
        n = w.numel()
        self._check(w, g, states, (carried, coefficients, keys, scaling), ends)
        if self.variant.count and ends is not None:
            pieces, end_at = ends.numel(), ends.data_ptr()
            counts = torch.zeros(pieces, 2, dtype=torch.int64)
        else:  # one piece: its counts, or zeros written to a buffer kept for them
            pieces, end_at = 1, (ctypes.c_int64 * 1)(n)
            counts = torch.zeros(1, 2, dtype=torch.int64) if self.variant.count else self._unused
        s0, s1 = [*states, None, None][:2]
        pointers = [
            t.data_ptr() if t is not None else None
            for t in (w, g, s0, s1, carried, coefficients, keys, scaling)
        ]
        threads = torch.get_num_threads()
        self._function(*pointers, threads, pieces, end_at, counts.data_ptr())
        return counts if self.variant.count else None

    def _check(self, w, g, states, others, ends) -> None:
        """The C loop reads and writes raw memory: each tensor must be the variant's, on the
        CPU, laid out densely, as long as the call; the pieces' ends must not go back, nor
        past the call's end."""
        n = w.numel()
        wanted = [(w, (torch.bfloat16, n)), (g, (torch.bfloat16, n))]
        wanted += [(s, self._states) for s in states] + list(zip(others, self._others, strict=True))
        if len(states) != self.variant.states:
            raise ValueError(
                f"pure bf16's native update ({self.variant}) takes {self.variant.states} states, "
                f"not {len(states)}"
            )
        for t, (dtype, size) in wanted:
            if t is None and dtype is None:
                continue
            if (
                t is None
                or t.dtype != dtype
                or not t.is_cpu
                or not t.is_contiguous()
                or t.numel() != (n if size is None else size)
            ):
                got = None if t is None else (t.dtype, tuple(t.shape), t.device)
                raise ValueError(
                    f"pure bf16's native update ({self.variant}) cannot take a tensor: {got}"
                )
        if ends is not None and not (
            ends.dtype == torch.int64
            and ends.is_cpu
            and ends.is_contiguous()
            and int(ends[-1]) == n
            and (ends.numel() == 1 or (ends[0] >= 0 and (ends.diff() >= 0).all()))
        ):
            raise ValueError(f"pure bf16's native update ({self.variant}): bad ends {ends}")


@functools.cache
def native(variant: Variant) -> NativeUpdate:
    """The variant's native update, built once per process (and once per machine)."""
    return NativeUpdate(variant)


def _library(variant: Variant) -> ctypes.CDLL:
    """The variant's library: loaded from the kernel folder, built there first if missing.
    A build with one thread a call (no OpenMP runtime) is kept under a name of its own, so
    that one with OpenMP replaces it once the runtime is there."""
    cc = compiler()
    reason = cannot_build()
    if reason:
        raise RuntimeError(f"pure bf16's native update cannot be built: {reason}")
    macros = [f"-D{k}={v}" for k, v in defines(variant).items()]
    error = ""
    for threading in (OPENMP, "-fopenmp-simd"):
        flags = [*FLAGS, threading, *macros]
        digest = hashlib.sha256(SOURCE.read_bytes())
        for part in (*flags, _version(cc), _cpu_features()):
            digest.update(part.encode())
        path = _kernel_dir() / f"pure_update_{digest.hexdigest()[:20]}.so"
        if path.is_file():
            return ctypes.CDLL(str(path))
        error = _build(cc, flags, path)
        if not error:
            return ctypes.CDLL(str(path))
    raise RuntimeError(f"{cc} could not build pure bf16's native update: {error}")


def _build(cc: str, flags: list[str], path: Path) -> str:
    """Compile in a folder of this build's own, check its known answer (`pure_probe`), then
    write it whole to `path` (mpexp/atomic.py: what a killed build left is removed by the
    next), readable by all (a kernel folder may be shared). What the compiler said where it
    failed, else ""."""
    with tempfile.TemporaryDirectory(prefix="mpexp-build-") as folder:
        built = Path(folder) / path.name
        command = [cc, *flags, "-x", "c", str(SOURCE), "-o", str(built)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return done.stderr.strip()[:500]
        probe = ctypes.CDLL(str(built)).pure_probe
        probe.restype, probe.argtypes = ctypes.c_int, [ctypes.c_float]
        if probe(1.0) != 1:
            raise RuntimeError(
                f"{cc} builds pure bf16's native update with float arithmetic that is not "
                "IEEE's (reassociated, fused or without NaNs: fast math?), which its roundings "
                "cannot take; set CC to gcc or clang"
            )
        write_whole(path, built.read_bytes())
    os.chmod(path, 0o755)
    return ""


def _kernel_dir() -> Path:
    """Where builds are kept: $MPEXP_KERNEL_DIR, else ~/.cache/mpexp/kernels; a temporary
    folder of this process's where neither can be written."""
    wanted = os.environ.get("MPEXP_KERNEL_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mpexp", "kernels"
    )
    try:
        Path(wanted).mkdir(parents=True, exist_ok=True)
        if os.access(wanted, os.W_OK):
            return Path(wanted)
    except OSError:
        pass
    return Path(_private_dir())


@functools.cache
def _version(cc: str) -> str:
    """What `cc --version` says (part of a build's name: a new compiler builds anew)."""
    return subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout


@functools.cache
def _private_dir() -> str:
    made = tempfile.mkdtemp(prefix="mpexp-kernels-")
    atexit.register(shutil.rmtree, made, ignore_errors=True)  # (a loaded library stays mapped)
    return made


# what /proc/cpuinfo says of the CPU that -march=native builds for: x86's flags and model, ARM's
# features and part
CPU_KEYS = ("vendor_id", "cpu family", "model", "model name", "flags", "Features",
            "CPU implementer", "CPU architecture", "CPU variant", "CPU part")  # fmt: skip


@functools.cache
def _cpu_features() -> str:
    """What -march=native builds for here (a build made on one CPU may not run on another)."""
    try:
        return cpu_key(Path("/proc/cpuinfo").read_text())
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def cpu_key(cpuinfo: str) -> str:
    """The lines of /proc/cpuinfo's text that name the CPU and what it can do (CPU_KEYS), once
    each: not a core's number or its clock."""
    mine = sorted({line for line in cpuinfo.splitlines() if line.split(":")[0].strip() in CPU_KEYS})
    return "\n".join(mine) or f"{platform.machine()} {platform.processor()}"
