"""mpexp/atomic.py, which the data caches write through: a file or folder appears whole or
not at all, and a partial one left by a killed writer is removed by the next writer, never one
whose writer is still at work; the text corpus's token cache is written so."""

from __future__ import annotations

import fcntl
import logging
import os

import pytest

from mpexp import atomic
from mpexp.data.text import TokenCache, path_source


def test_a_file_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "cache" / "tokens.bin"
    with pytest.raises(RuntimeError), atomic.whole_file(target) as out:
        out.write(b"half")
        raise RuntimeError("the disk filled")
    assert not target.exists() and list(target.parent.iterdir()) == []
    atomic.write_whole(target, b"whole")
    assert target.read_bytes() == b"whole" and list(target.parent.iterdir()) == [target]


def test_only_a_partial_whose_writer_is_gone_is_removed(tmp_path):
    target = tmp_path / "tokens.bin"
    abandoned = tmp_path / "tokens.bin.111-aaaa.partial"  # its writer was killed: no lock
    abandoned.write_bytes(b"x" * 1000)
    at_work = tmp_path / "tokens.bin.222-bbbb.partial"
    at_work.write_bytes(b"y")
    held = os.open(at_work, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as its writer holds it
    try:
        assert atomic.remove_abandoned(target) == [abandoned]
        assert at_work.exists() and not abandoned.exists()
    finally:
        os.close(held)
    assert atomic.remove_abandoned(target) == [at_work]  # its writer gone too


def test_a_killed_token_cache_builds_partial_file_is_removed_by_the_next(tmp_path, caplog):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be\n" * 50)
    cache = TokenCache(path_source(str(corpus)), tmp_path / "cache")
    cache.tokens_path.parent.mkdir()
    left = cache.tokens_path.with_name(cache.tokens_path.name + ".4242-0000.partial")
    left.write_bytes(b"t" * 500)  # what a build killed halfway leaves (before: it stayed)
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        tokens = cache.open()
    assert len(tokens) == corpus.stat().st_size and not left.exists()
    assert any(str(left) in r.getMessage() for r in caplog.records)
