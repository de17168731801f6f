"""The GPT at the size experiment=gpt2_small ships: every pass runs the training step's
micro-batch (validation, the attention-logit diagnostic, compiled or not), the loss never copies
all the logits to float32, and the loss compiled with the model equals the eager one."""

from __future__ import annotations

import importlib
import logging
import math
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from mpexp.models.gpt import GPT
from mpexp.run.runner import train
from mpexp.step.objective import Objective
from mpexp.step.validation import evaluate
from mpexp.tasks import cross_entropy as chunked
from mpexp.tasks.language_model import LanguageModelling
from mpexp.tracking.run_context import RunContext
from tests.conftest import CPU, make_cfg, precision_of
from tests.test_compile import Backend
from tests.test_language_model import tiny_lm
from tests.test_tokens import VOCAB, bin_pair, tokens_data
from tests.test_training import read_metrics

# GPT-2 small's padded head, and the preset's micro-batch: 480 windows / 40 micro-batches
HEAD, MICRO, WINDOW = 50304, 12, 1024


class BatchRecordingGPT(GPT):
    """The GPT, noting each pass it makes on real tensors: (training, measuring the attention
    logits, windows)."""

    passes: ClassVar[list[tuple[bool, bool, int]]] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.device.type != "meta":  # the FLOP count's pass holds no memory
            measuring = self.blocks[0].attn.measure_logits
            type(self).passes.append((self.training, measuring, len(tokens)))
        return super().forward(tokens)


def test_gpt2_small_validates_and_measures_attention_one_micro_batch_at_a_time(tmp_path, caplog):
    """The preset's 480-window batch and 40 micro-batches, a tiny GPT: no pass, training,
    validation (of the weights and of their moving average) or the diagnostics', takes more than
    the step's 12 windows (the whole batch at
    once is what made GPT-2 small's first validation need about 150 GB)."""
    # the class as the run imports it by its name (pytest may have imported this file as another)
    recorder = importlib.import_module("tests.test_lm_scale").BatchRecordingGPT
    recorder.passes.clear()
    cfg = make_cfg(
        "experiment=gpt2_small", f"dataset.path={bin_pair(tmp_path / 'data')}",
        f"dataset.vocab_size={VOCAB}", "model._target_=tests.test_lm_scale.BatchRecordingGPT",
        "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=8",
        "dataset.train_size=960", "trainer.max_steps=2", "scheduler.warmup_steps=1",
        "diagnostics.grad_stats_every=1", "trainer.progress=false", "wandb.mode=disabled",
        "trainer.ema_decay=0.9", "trainer.ema_every=1",  # val_ema/: validated a second time
    )  # fmt: skip
    assert (cfg.dataset.batch_size, cfg.trainer.accumulate) == (480, 40)  # the preset's own
    with caplog.at_level(logging.INFO, logger="mpexp"):
        train(cfg, RunContext(tmp_path / "run"))
    first = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Training"))
    assert (  # the run's first line: the batch in tokens, per step and per micro-batch
        "3,840 tokens (480 windows) per optimizer step, 96 tokens (12 windows) per micro-batch, "
        "40 micro-batches" in first
    )
    passes = recorder.passes[1:]  # after the model's trial on one window, as it is built
    training = [n for train_mode, _, n in passes if train_mode]
    measuring = [n for train_mode, m, n in passes if m and not train_mode]
    validating = [n for train_mode, m, n in passes if not (m or train_mode)]
    assert training == [MICRO] * 80  # 2 steps of 40 micro-batches
    assert measuring == [MICRO] * 80  # the diagnostics' pass on each step's batch
    # the weights, then their moving average (val_ema/), each in micro-batches
    assert max(validating) == MICRO and sum(validating) == 2 * cfg.dataset.val_size


def test_a_compiled_validation_pads_its_last_micro_batch_not_the_optimizer_batch(tmp_path):
    """Compiled, validation's graph is the micro-batch's: its last, smaller micro-batch is
    padded to 12 windows, never to the 480 of an optimizer step."""
    data = tokens_data(bin_pair(tmp_path / "data"), batch_size=480, val_size=30, block_size=8)
    task = data.setup(CPU)
    model = GPT(vocab_size=task.model_vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=16)
    backend = Backend()
    compiled = torch.compile(Objective(model, task), backend=backend, dynamic=False)
    fp32 = precision_of("fp32")
    metrics = evaluate(compiled, data, CPU, fp32, pad=True, micro_batch=MICRO)
    assert {shapes[0] for _, shapes in backend.graphs} == {(MICRO, 8)}  # one graph's windows
    eager = evaluate(model, data, CPU, fp32)
    assert metrics == pytest.approx(eager, rel=1e-5)


class LargestOutputs(TorchDispatchMode):
    """The largest tensor any operation makes, per dtype, in elements."""

    def __init__(self):
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
        return out


def largest_outputs(loss_of, backward: bool = True) -> dict[torch.dtype, int]:
    """What the loss's forward and backward passes make at the preset's size, on fake tensors
    (shapes and dtypes, no memory): bf16 logits of a micro-batch of 12 x 1,024 tokens."""
    with FakeTensorMode():
        logits = torch.empty(MICRO * WINDOW, HEAD, dtype=torch.bfloat16, requires_grad=backward)
        targets = torch.zeros(MICRO * WINDOW, dtype=torch.long)
        with LargestOutputs() as made:
            loss = loss_of(logits, targets)
            if backward:
                loss.backward()
    return made.largest


def test_the_loss_at_gpt2_small_size_makes_no_float32_copy_of_the_logits():
    """GPT-2 small's micro-batch of bf16 logits: the chunked loss's largest float32 tensor is one
    chunk's (a tenth of the logits), where F.cross_entropy on the logits cast to float32 makes
    the whole 2.5 GB; its gradient is bf16, as the logits are. Validation's sums likewise."""
    task = LanguageModelling(vocab_size=50257, block_size=WINDOW, z_loss=1e-4)
    ours = largest_outputs(lambda logits, y: task.loss(logits, y))
    reference = largest_outputs(lambda logits, y: F.cross_entropy(logits.float(), y))
    whole = MICRO * WINDOW * HEAD
    assert reference[torch.float32] == whole  # what the test would see of a float32 copy
    assert ours[torch.float32] <= chunked.rows_per_chunk(HEAD) * HEAD < whole / 8
    assert ours[torch.bfloat16] == whole  # the gradient, in the logits' dtype
    sums = largest_outputs(lambda logits, y: task.val_sums(logits, y), backward=False)
    assert sums[torch.float32] <= chunked.rows_per_chunk(HEAD) * HEAD  # validation's too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_and_its_gradient_are_float32_cross_entropys(monkeypatch, dtype):
    """Over several chunks (one of them shorter), with the z-loss: the loss and the gradient
    of cross_entropy(logits.float()) + w * mean(logsumexp^2), to float32 rounding."""
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4 * 500 * 64)  # 64 rows a chunk
    torch.manual_seed(0)
    logits = (3 * torch.randn(300, 500)).to(dtype).requires_grad_()
    targets = torch.randint(500, (300,))
    task = LanguageModelling(vocab_size=500, block_size=300, z_loss=1e-2)
    loss = task.loss(logits[None], targets[None])
    loss.backward()
    exact = logits.detach().float().requires_grad_()
    reference = F.cross_entropy(exact, targets) + 1e-2 * exact.logsumexp(-1).square().mean()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert logits.grad.dtype == dtype
    tolerance = 1e-7 if dtype == torch.float32 else 2e-5  # bf16's rounding of each gradient
    torch.testing.assert_close(logits.grad.float(), exact.grad, atol=tolerance, rtol=1e-2)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_the_loss_compiled_with_the_model_is_the_eager_loss(mode):
    """The Objective compiled whole (model and loss in one graph, through AOTAutograd as a run's
    compilation goes) gives the eager loss and gradients, to bf16's tolerance under bf16."""
    torch.manual_seed(0)
    task = LanguageModelling(vocab_size=VOCAB, block_size=16, z_loss=1e-3)
    model = GPT(vocab_size=task.model_vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=32)
    objective = Objective(model, task)
    compiled = torch.compile(objective, backend="aot_eager", dynamic=False)
    tokens = torch.randint(VOCAB, (4, 17))
    precision = precision_of(mode)
    results = []
    for run in (objective, compiled):
        model.zero_grad()
        with precision.autocast():
            loss = run(tokens[:, :-1], tokens[:, 1:]).sum()  # cross-entropy and z-loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    tol = {"fp32": (1e-5, 1e-6), "bf16": (2e-2, 2e-3)}[mode]
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=tol[0], atol=tol[1])
    for ours, theirs in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=tol[0], atol=tol[1])


def test_train_loss_is_the_cross_entropy_and_the_z_loss_is_logged_beside_it(tmp_path):
    """With trainer.z_loss, train/loss is still the cross-entropy, comparable with runs without
    it (at the first step, before any update, the two are equal), and the z-loss term added to it
    is logged as train/z_loss: at initialisation about w x ln(256)^2, every logit near 0."""
    first = {}
    for weight in (0.0, 0.5):
        more = (f"trainer.z_loss={weight}", "trainer.epochs=1", "dataset.train_size=64")
        train(make_cfg(*tiny_lm(tmp_path, *more)), RunContext(tmp_path / str(weight)))
        first[weight] = read_metrics(tmp_path / str(weight))[0][0]
    assert first[0.5]["train/loss"] == pytest.approx(first[0.0]["train/loss"], rel=1e-6)
    assert "train/z_loss" not in first[0.0]
    assert first[0.5]["train/z_loss"] == pytest.approx(0.5 * math.log(256) ** 2, rel=0.05)


def test_bits_per_byte_count_exactly_the_bytes_of_the_targets_scored():
    """With each id's length in bytes, val/bpb on 32 windows is the summed cross-entropy in bits
    over the bytes its targets are, counted on the device; padding (a compiled validation's last
    micro-batch) scores no byte."""
    torch.manual_seed(0)
    vocab, window = 320, 16
    lengths = torch.randint(1, 8, (vocab,))  # a BPE's ids: 1 to 7 bytes each
    task = LanguageModelling(vocab, window, bytes_per_token=4.0, token_bytes=lengths)
    logits, targets = torch.randn(32, window, vocab), torch.randint(vocab, (32, window))
    nats = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="sum")
    exact = float(nats) / math.log(2) / int(lengths[targets].sum())
    metrics = task.val_metrics(task.val_sums(logits, targets).tolist(), targets.numel())
    assert metrics["val/bpb"] == pytest.approx(exact, rel=1e-6)
    padded = task.val_sums(
        torch.cat((logits, torch.randn(4, window, vocab))), task.padded_targets(targets, 36)
    )
    torch.testing.assert_close(padded, task.val_sums(logits, targets))
    assert task.record()["exact_bpb"] is True and "token_bytes" not in task.record()
