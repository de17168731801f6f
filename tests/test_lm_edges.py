"""Language-model data and sampling at their edges: a nanoGPT file shorter than a header, a
meta.pkl whose vocabulary no file can hold, targets marked to be ignored, and sampling past the
model's context as nanoGPT samples (the output layer on the last position alone)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mpexp.data.tokens import TokenFiles
from mpexp.errors import ConfigError, DataError
from mpexp.models.gpt import GPT
from mpexp.sample import Draw, generate
from mpexp.tasks import cross_entropy as ce_module
from mpexp.tasks.language_model import LanguageModelling
from tests.conftest import CPU


def test_a_nanogpt_file_shorter_than_a_header_and_not_a_multiple_of_4_bytes_is_read(tmp_path):
    # 301 uint16 ids: 602 bytes, which the llm.c header check read as int32 with a ValueError
    ids = np.arange(301, dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")
    ids.tofile(tmp_path / "val.bin")
    data = TokenFiles(str(tmp_path), vocab_size=512, block_size=8)
    data.setup(CPU)
    assert len(data.train_tokens) == 301
    (tmp_path / "train.bin").write_bytes(ids.tobytes() + b"\0")  # 603 bytes: one message
    with pytest.raises(DataError, match="holds 603 bytes, not a whole number of uint16 tokens"):
        TokenFiles(str(tmp_path), vocab_size=512, block_size=8).setup(CPU)


def test_a_vocabulary_no_token_file_can_hold_is_refused_at_once(tmp_path):
    np.arange(301, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 2**70}))
    for attempt in (TokenFiles(str(tmp_path), block_size=8).planned_task,
                    lambda: TokenFiles(str(tmp_path), block_size=8).setup(CPU)):  # fmt: skip
        with pytest.raises(DataError, match=r"vocab_size 1,180,591,620,717,411,303,424, more ids"):
            attempt()
    (tmp_path / "meta.pkl").unlink()
    with pytest.raises(ConfigError, match=r"dataset\.vocab_size=8589934592 must lie in"):
        TokenFiles(str(tmp_path), vocab_size=2**33, block_size=8).setup(CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["eager", "chunked", "compiled"])
def test_the_training_loss_leaves_out_ignored_targets_as_f_cross_entropy_does(
    dtype, how, monkeypatch
):
    # a -100 target counted as class 0 before (and indexed out of range compiled)
    torch.manual_seed(0)
    task = LanguageModelling(vocab_size=50, block_size=16, z_loss=0.1)
    logits = torch.randn(4, 16, 64, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 50, (4, 16))
    targets[:, ::3] = -100
    if how == "chunked":  # several chunks of rows: the loss's own backward pass, chunk by chunk
        monkeypatch.setattr(ce_module, "CHUNK_BYTES", 4 * 64 * 10)
    loss_terms = torch.compile(task.loss_terms, backend="aot_eager") if how == "compiled" else (
        task.loss_terms
    )  # fmt: skip
    terms = loss_terms(logits, targets)
    terms.sum().backward()
    grad, logits.grad = logits.grad, None

    flat, kept = logits.float().reshape(-1, 64), targets.reshape(-1) != -100
    ce = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100)
    z = torch.logsumexp(flat, dim=-1)[kept].square().mean()
    (ce + 0.1 * z).backward()
    assert terms[0].item() == pytest.approx(ce.item(), rel=1e-6)
    assert terms[1].item() == pytest.approx(0.1 * z.item(), rel=1e-5)
    rounding = 1e-6 if dtype == torch.float32 else 2e-3  # bf16: the gradient's one rounding
    torch.testing.assert_close(grad.float(), logits.grad.float(), atol=rounding, rtol=0)
    assert not grad[:, ::3].any()  # an ignored target's row has no gradient


def test_sampling_past_the_context_runs_the_output_layer_on_the_last_position_alone():
    torch.manual_seed(0)
    vocab, block, width = 64, 16, 32
    model = GPT(vocab_size=vocab, block_size=block, n_layer=2, n_embd=width).eval()
    window = torch.randint(vocab, (1, block))

    def flops(run) -> int:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            run()
        return counter.get_total_flops()

    # one token after a context longer than block_size: the last block_size tokens run whole,
    # the head (2 x width x vocab a position) on one of them, not all 16 (1.6x the cost at
    # GPT-2 small's context of 1,024)
    prompt = torch.randint(vocab, (block + 4,)).tolist()
    sampled = flops(lambda: generate(model, prompt, vocab, Draw(tokens=1), cached=False))
    whole = flops(lambda: model(window))
    assert sampled == whole - (block - 1) * 2 * width * vocab
    torch.testing.assert_close(model.last_logits(window), model(window)[:, -1])
