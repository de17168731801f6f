"""What a file's bytes say, cheaply: a digest of its size and of its first and last `EDGE`
bytes, for keys that a file rewritten in place must change (the image cache's, an image
folder's resume key), where its size and modification time could stay as they were (`touch -r`,
`rsync -t`, an archive unpacked with its times).

A photo of ImageNet's size (110 KB on average) is read whole, a larger one at its two ends: a
file's header and its end hold what an edit or a re-encoding changes (a JPEG's tables, the end of
its compressed data, which an edit shifts). The files are read by threads (the work waits on the
disk, which reads several at once), and split among the ranks of a distributed run, each rank
reading its share and every rank then holding all of them (docs/speed.md gives the cost).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mpexp.distributed import gathered

EDGE = 64 * 1024  # bytes read at each end of a file
THREADS = 16  # reads in flight: an SSD or a network file system serves many at once
BATCH = 512  # files a thread reads in one task (one task per file costs more than its read)
UNREADABLE = np.uint64(0)  # the digest of a file that cannot be read (a link to nothing)


def file_digest(path: str | bytes, size: int) -> np.uint64:
    """The digest of one file of `size` bytes (as the folder's walk found it): its size, its
    first and last EDGE bytes; UNREADABLE where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            head = os.pread(fd, EDGE, 0)
            tail = os.pread(fd, EDGE, max(EDGE, size - EDGE)) if size > EDGE else b""
        finally:
            os.close(fd)
    except OSError:
        return UNREADABLE
    digest = hashlib.blake2b(size.to_bytes(8, "little", signed=True), digest_size=8)
    digest.update(head)
    digest.update(tail)
    return np.frombuffer(digest.digest(), dtype=np.uint64)[0]


def file_digests(paths: list, sizes: np.ndarray, rank: int = 0, world_size: int = 1) -> np.ndarray:
    """Each file's `file_digest` (`sizes`: theirs as the walk found them), as a uint64 array in
    the order of `paths`: this rank reading every world_size-th stretch of BATCH files, the
    ranks' shares gathered, so that every rank holds them all."""
    stretches = range(0, len(paths), BATCH)
    mine = stretches[rank::world_size]
    sizes = sizes.tolist()

    def read(first: int) -> np.ndarray:
        files = zip(paths[first : first + BATCH], sizes[first : first + BATCH], strict=True)
        return np.array([file_digest(p, size) for p, size in files], dtype=np.uint64)

    with ThreadPoolExecutor(THREADS, thread_name_prefix="mpexp-digest") as pool:
        shares = dict(zip(mine, pool.map(read, mine), strict=True))
    digests = np.empty(len(paths), dtype=np.uint64)
    for share in gathered(shares) if world_size > 1 else [shares]:
        for first, values in share.items():
            digests[first : first + len(values)] = values
    return digests
