"""A compiled model's every compilation, in training and in validation: counted in perf/compile_s,
survived by the eager model when it fails, and none for a last, smaller validation batch, which is
padded to the full size (its padding counted nowhere) rather than compiled a graph of its own.

Most of these compile with a backend that runs each graph as traced (TorchDynamo's work without
code generation: seconds on a CPU), recording what it was given; one compiles with inductor, as a
run does (slow).
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from torch import nn

from mpexp.data.synthetic import SyntheticData
from mpexp.data.text import TextData
from mpexp.models.simplecnn import SimpleCNN
from mpexp.run.runner import train
from mpexp.step import performance
from mpexp.step.validation import evaluate
from mpexp.tracking.run_context import RunContext
from tests.conftest import CPU, TINY, make_cfg, precision_of

# TINY's 64-sample batches; a validation set of 203 leaves a last batch of 11, a size that none of
# the model's weights has as its first dimension (width 8: 8, 16, 10), so a graph's shapes tell it
VAL_SIZE, LAST = 203, 11


class Backend:
    """A torch.compile backend: records each graph's grad mode and input shapes, then runs it as
    traced; `fail(grad, shapes)` says which graphs it cannot compile, `slow` how long an eval
    graph (no gradients) takes to compile."""

    def __init__(self, fail=None, slow: float = 0.0):
        self.graphs: list[tuple[bool, list[tuple]]] = []
        self.fail, self.slow = fail, slow

    def __call__(self, gm, inputs):
        graph = (torch.is_grad_enabled(), [tuple(t.shape) for t in inputs if torch.is_tensor(t)])
        self.graphs.append(graph)
        if self.fail is not None and self.fail(*graph):
            raise RuntimeError("no kernel for this graph")
        if not graph[0]:
            time.sleep(self.slow)
        return gm.forward


def compiled_run(monkeypatch, tmp_path, backend: Backend, *overrides: str):
    """A compiled TINY run through train(), its graphs compiled by `backend`; the summary and the
    epoch rows."""
    compile_ = torch.compile

    def with_backend(model, mode, dynamic):
        return compile_(model, backend=backend, dynamic=dynamic)

    monkeypatch.setattr(performance.torch, "compile", with_backend)
    torch._dynamo.reset()  # nothing compiled by an earlier test is reused
    cfg = make_cfg(*TINY, f"dataset.val_size={VAL_SIZE}", "trainer.compile=true", *overrides)
    summary = train(cfg, RunContext(tmp_path / "compiled"))
    monkeypatch.undo()
    rows = [json.loads(line) for line in (tmp_path / "compiled" / "metrics.jsonl").open()]
    return summary, [r for r in rows if "val/loss" in r]


def test_a_compiled_run_compiles_one_graph_to_train_and_one_to_validate_and_times_both(
    monkeypatch, tmp_path
):
    """The last validation batch (11 of 203) runs through the full batches' graph, static; its
    metrics are the eager run's; validation's compilation is in perf/compile_s, only in the epoch
    that compiled it."""
    backend = Backend(slow=0.5)
    summary, epochs = compiled_run(monkeypatch, tmp_path, backend, "dataset.train_size=256")
    assert [grad for grad, _ in backend.graphs] == [True, False]  # training's, validation's
    shapes = [s for _, graph in backend.graphs for s in graph]
    assert all(isinstance(n, int) for s in shapes for n in s)  # no dynamic-shape graph
    assert not any(s and s[0] == LAST for s in shapes)
    cfg = make_cfg(*TINY, f"dataset.val_size={VAL_SIZE}", "dataset.train_size=256")
    eager = train(cfg, RunContext(tmp_path / "eager"))
    for key in ("val/loss", "val/acc", "train/epoch_loss"):
        assert summary[key] == pytest.approx(eager[key], rel=1e-5), key
    assert summary["ran"]["compile"] == "default"
    assert epochs[0]["perf/compile_s"] >= 0.5  # the eval graph's half second of compiling
    assert "perf/compile_s" not in epochs[1]  # nothing left to compile
    assert summary["perf/compile_s"] == pytest.approx(epochs[0]["perf/compile_s"])


def test_a_validation_that_cannot_be_compiled_runs_eagerly_with_one_warning(
    monkeypatch, tmp_path, caplog
):
    """Training compiled, validation's graph fails: the run goes on eagerly, training included,
    with one warning, recorded as compile: false; its validation is the eager model's."""
    backend = Backend(fail=lambda grad, shapes: not grad)
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        summary, epochs = compiled_run(monkeypatch, tmp_path, backend)
    warned = [r.getMessage() for r in caplog.records if "could not compile" in r.getMessage()]
    assert len(warned) == 1 and "no kernel for this graph" in warned[0]
    assert summary["ran"]["compile"] is False
    assert [grad for grad, _ in backend.graphs] == [True, False]  # never tried again
    assert len(epochs) == 2 and summary["val/loss"] < 2.3


def test_a_later_training_step_that_cannot_be_compiled_trains_eagerly_with_one_warning(
    monkeypatch, tmp_path, caplog
):
    """A last, smaller training batch (dataset.drop_last=false: 1000 = 15 x 64 + 40) compiles a
    graph of its own; failing, that step and the rest train eagerly: every step is taken once."""
    backend = Backend(fail=lambda grad, shapes: grad and any(s and s[0] == 40 for s in shapes))
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        summary, epochs = compiled_run(
            monkeypatch, tmp_path, backend, "dataset.train_size=1000", "dataset.drop_last=false"
        )
    warned = [r.getMessage() for r in caplog.records if "could not compile" in r.getMessage()]
    assert len(warned) == 1 and summary["ran"]["compile"] is False
    assert [r["step"] for r in epochs] == [16, 32]
    # the batch of 40 got a static graph of its own, not one for any batch size
    assert all(isinstance(n, int) for _, graph in backend.graphs for s in graph for n in s)
    assert summary["val/loss"] < 2.3


class Recorded(nn.Module):
    """A model, and the batch sizes and strides it was called with."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.sizes, self.strides = model, [], set()

    def forward(self, x):
        self.sizes.append(len(x))
        self.strides.add(x.stride())
        return self.model(x)


def text_data(tmp_path, batch_size: int) -> TextData:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(400)))
    data = TextData(
        path=str(corpus), block_size=16, val_size=37, cache_dir=str(tmp_path / "cache"),
        batch_size=batch_size,
    )  # fmt: skip
    data.setup(CPU)
    return data


@pytest.mark.parametrize("task", ["classification", "channels_last", "language_model"])
def test_padding_the_last_validation_batch_leaves_the_metrics_as_they_were(tmp_path, task):
    """Every batch the model sees is full, with the strides of the others (which a compiled
    graph's guards check: text windows are cut from longer ones, images may be stored
    channels-last); the padding counts in no sum, loss or accuracy."""
    torch.manual_seed(0)
    if task != "language_model":
        data = SyntheticData(train_size=64, val_size=VAL_SIZE, batch_size=64, seed=0, noise=0.5)
        data.setup(CPU, torch.channels_last if task == "channels_last" else torch.contiguous_format)
        model = Recorded(SimpleCNN(in_channels=1, num_classes=10, image_size=(28, 28), width=4))
    else:
        data = text_data(tmp_path, batch_size=16)
        model = Recorded(nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 256)))
    fp32 = precision_of("fp32")
    plain = evaluate(model, data, CPU, fp32)
    sizes, model.sizes, model.strides = model.sizes, [], set()
    padded = evaluate(model, data, CPU, fp32, pad=True)
    assert sizes[-1] < data.batch_size and set(model.sizes) == {data.batch_size}
    assert len(model.strides) == 1
    assert padded == pytest.approx(plain, rel=1e-6)
    assert model.training  # left as it was found


@pytest.mark.slow
def test_inductor_compiles_no_graph_for_the_last_validation_batch():
    """With the compiler a run uses: validation compiles one graph, the full batches', whose
    metrics are the eager model's up to rounding."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    data = SyntheticData(train_size=64, val_size=VAL_SIZE, batch_size=64, seed=0, noise=0.5)
    data.setup(CPU)
    model = SimpleCNN(in_channels=1, num_classes=10, image_size=(28, 28), width=4)
    speed = performance.Speed(True, "default", False, False, None)
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    fp32 = precision_of("fp32")
    with performance.Compilations() as compiles:
        compiled = evaluate(performance.compile_model(model, speed), data, CPU, fp32, pad=True)
    assert counters["stats"]["unique_graphs"] - graphs == compiles.count == 1
    assert compiles.seconds > 0
    eager = evaluate(model, data, CPU, fp32)
    assert compiled == pytest.approx(eager, rel=1e-4)
