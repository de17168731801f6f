"""How an optimizer step's batch is split: into micro-batches, and among processes.

`dataset.batch_size` is the optimizer's batch, the samples one step learns from, however many
processes share it: torchrun changes how fast a step goes, not what it computes. The batch runs
as `trainer.accumulate` micro-batches (the samples one forward pass holds), dealt out among the
processes as nanoGPT deals out its gradient-accumulation steps: each of N processes takes
batch_size / N samples a step and runs accumulate / N micro-batches of them. Without
accumulation (accumulate=1) each process runs its share in one pass.

Validation and the diagnostics' extra forward pass run the same micro-batches (mpexp/step/).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpexp.errors import ConfigError


@dataclass(frozen=True)
class BatchSplit:
    batch: int  # samples per optimizer step, over all processes (dataset.batch_size)
    accumulate: int  # micro-batches per optimizer step, over all processes (trainer.accumulate)
    processes: int = 1

    def __post_init__(self) -> None:
        n, k, batch = self.processes, self.accumulate, self.batch
        if k > 1 and k % n:
            raise ConfigError(
                f"trainer.accumulate={k} micro-batches cannot be shared among {n} processes: "
                f"each process runs accumulate / {n} of them. {accumulate_advice(batch, k, n)}"
            )
        if batch % n:
            step = k if k > 1 else n  # a multiple of the micro-batches, which are n's multiple
            raise ConfigError(
                f"dataset.batch_size={batch} (the optimizer step's, over all processes) cannot "
                f"be shared equally among {n} processes; use a multiple of {step} "
                f"(dataset.batch_size={nearest_multiple(batch, step)})."
            )

    @property
    def per_process(self) -> int:
        """Samples each process takes per step."""
        return self.batch // self.processes

    @property
    def accumulate_per_process(self) -> int:
        """Micro-batches each process runs per step."""
        return max(1, self.accumulate // self.processes)

    @property
    def micro_batch(self) -> int:
        """Samples per forward pass."""
        return self.per_process // self.accumulate_per_process

    def describe(self, tokens_per_sample: int | None = None) -> str:
        """The split in words, for the run's first log line: "491,520 tokens per optimizer step
        (480 windows), 12,288 per micro-batch (12 windows), 40 micro-batches on 1 process"."""

        def amount(samples: int) -> str:
            if tokens_per_sample is None:
                return f"{samples:,} samples"
            return f"{samples * tokens_per_sample:,} tokens ({samples:,} windows)"

        where = "" if self.processes == 1 else f" on each of {self.processes} processes"
        return (
            f"{amount(self.batch)} per optimizer step, {amount(self.micro_batch)} per "
            f"micro-batch, {self.accumulate_per_process} micro-batch"
            f"{'es' if self.accumulate_per_process > 1 else ''}{where}"
        )


def accumulate_choices(batch: int, processes: int) -> list[int]:
    """The trainer.accumulate values that split `batch` among `processes`: 1 and those that
    divide the batch into equal micro-batches and deal them out equally (multiples of
    `processes`); none where the processes cannot share the batch at all."""
    if batch % processes:
        return []
    return [1, *(k for k in range(processes, batch + 1, processes) if k > 1 and batch % k == 0)]


def accumulate_advice(batch: int, accumulate: int, processes: int) -> str:
    """What to set instead of `accumulate`: the choices nearest to it, or else a count with a
    batch that takes it; never what the same run refuses next."""
    choices = accumulate_choices(batch, processes)
    near = sorted(
        {*[k for k in choices if k < accumulate][-1:], *[k for k in choices if k > accumulate][:1]}
        - {1}
    )
    one = ", or trainer.accumulate=1" if choices else ""
    if near:
        named = " or ".join(f"trainer.accumulate={k}" for k in near)
        what = "a divisor of" if processes == 1 else f"a multiple of {processes} that divides"
        return f"Use {named} ({what} dataset.batch_size={batch}){one}."
    k = processes * -(-accumulate // processes)
    return (
        f"No count of micro-batches above 1 divides dataset.batch_size={batch}"
        f"{'' if processes == 1 else f' and is a multiple of {processes}'}: use "
        f"trainer.accumulate={k} with dataset.batch_size={nearest_multiple(batch, k)}{one}."
    )


def nearest_multiple(value: int, step: int) -> int:
    """The multiple of `step` nearest to `value` (`step` itself at least)."""
    return max(step, step * round(value / step))
