"""dataset.batch_size is the optimizer step's batch on any number of processes: each process
takes its share and runs its share of the trainer.accumulate micro-batches (the 2-process run
that equals one process step for step is tests/test_distributed.py's)."""

from __future__ import annotations

import re

import pytest

from mpexp.batches import BatchSplit
from mpexp.errors import ConfigError
from mpexp.validate import validate
from tests.conftest import make_cfg


@pytest.mark.parametrize(
    ("batch", "accumulate", "processes", "per_process", "micro_batches", "micro_batch"),
    [
        (480, 40, 1, 480, 40, 12),  # gpt2_small on one GPU
        (480, 40, 8, 60, 5, 12),  # and on 8, as nanoGPT's 5 steps a GPU: the same micro-batch
        (64, 1, 2, 32, 1, 32),  # no accumulation: each process its half in one pass
        (64, 4, 2, 32, 2, 16),
    ],
)
def test_each_process_takes_its_share_of_the_batch_and_of_the_micro_batches(
    batch, accumulate, processes, per_process, micro_batches, micro_batch
):
    split = BatchSplit(batch, accumulate, processes)
    assert (split.per_process, split.accumulate_per_process, split.micro_batch) == (
        per_process,
        micro_batches,
        micro_batch,
    )


@pytest.mark.parametrize(
    ("batch", "accumulate", "processes", "message"),
    [
        (480, 40, 3, "trainer.accumulate=40 micro-batches cannot be shared among 3 processes"),
        (63, 1, 2, "dataset.batch_size=63 (the optimizer step's, over all processes) cannot"),
    ],
)
def test_a_batch_the_processes_cannot_share_is_refused_naming_both_numbers(
    batch, accumulate, processes, message
):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BatchSplit(batch, accumulate, processes)


def test_the_split_in_words_gives_tokens_per_step_and_per_micro_batch():
    assert BatchSplit(480, 40, 8).describe(tokens_per_sample=1024) == (
        "491,520 tokens (480 windows) per optimizer step, 12,288 tokens (12 windows) per "
        "micro-batch, 5 micro-batches on each of 8 processes"
    )
    assert BatchSplit(64, 1).describe() == (
        "64 samples per optimizer step, 64 samples per micro-batch, 1 micro-batch"
    )


def _advised(message: str, batch: int, accumulate: int) -> list[tuple[int, int]]:
    """The (dataset.batch_size, trainer.accumulate) pairs a refusal advises: the divisors the
    config's check lists, or the values the split's message names."""
    if "use a divisor of" in message:
        return [(batch, int(k)) for k in re.findall(r"\d+", message.rsplit(": ", 1)[1])]
    advice = re.split(r"\b[Uu]se ", message, maxsplit=1)[1]
    pairs = re.findall(r"trainer\.accumulate=(\d+)(?: with dataset\.batch_size=(\d+))?", advice)
    pairs = [(int(b) if b else batch, int(k)) for k, b in pairs]
    alone = re.findall(r"\(dataset\.batch_size=(\d+)\)", advice)  # the batch: the one change
    return pairs + [(int(b), accumulate) for b in alone]


@pytest.mark.parametrize("processes", [2, 3, 8])
def test_the_accumulation_advice_is_never_refused_in_its_turn(processes, monkeypatch):
    # for batch 480 and accumulate 40 on 3 processes the advice was trainer.accumulate=42,
    # which does not divide 480: refused by the config's own check next
    monkeypatch.setenv("WORLD_SIZE", str(processes))
    cfg = make_cfg()
    for batch in (480, 100, 64):
        for accumulate in range(1, 50):
            cfg.dataset.batch_size, cfg.trainer.accumulate = batch, accumulate
            try:
                validate(cfg)
                BatchSplit(batch, accumulate, processes)
                continue
            except ConfigError as refused:
                message = str(refused)
            advice = _advised(message, batch, accumulate)
            assert advice, message
            for advised_batch, advised in advice:
                assert advised_batch % advised == 0, message
                BatchSplit(advised_batch, advised, processes)  # taken
    with pytest.raises(ConfigError) as refused:
        BatchSplit(480, 40, 3)
    assert _advised(str(refused.value), 480, 40) == [(480, 30), (480, 48), (480, 1)]
