"""Summing a group's gradients through shared memory when every rank of the group is a CPU process on one host:
the buckets of `parallel.runtime.dp.data_parallel.GradientReducer` when `parallel.shared_memory_reduce` is on.

Written by hand because gloo, torch's CPU backend, has one transport, TCP: between two processes of one machine its
all-reduce copies every byte through the kernel's sockets, in both directions, and keeps a core busy doing it. Here
the gradient buckets of every rank are rows of one tensor mapped from one /dev/shm file (`shared_rows`): a rank's
buckets are views into its own row, so backward writes its gradients there. A reduction (`sum_rows`) is a barrier
(every rank's row is final), each rank summing its 1/N slice of the columns over the rows and writing the sum into
every row, and a second barrier (every slice is summed): every rank then reads the same bits, since each element is
summed once, by one rank, in row order. This is what NCCL does between the GPUs of one node, and DeepSpeed's shared
memory all-reduce between CPU ranks; gloo has neither.

Set up with `shared_rows`: rank 0 of the group creates the file (if /dev/shm has room for it four times over: Ray's
object store lives there too), takes all its pages at once, and writes a token into it; every rank maps it and
reads the token back (a rank on another host, or with a /dev/shm of its own, does not see it); the group agrees
whether every rank did; then rank 0 unlinks the file, so nothing is left behind once the mappings go, however the
processes end. A group that cannot share gets None on every rank, and its reducer uses gloo's collective.
"""

from __future__ import annotations

import mmap
import os
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
HEADROOM = 4
"""/dev/shm must have this many times the rows' bytes free: Ray's object store takes its pages from there as it
fills (lazily), so the rows take at most a quarter of what is free."""


def shared_rows(group: dist.ProcessGroup, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A [group size, numel] tensor of zeros in memory every rank of `group` maps (`numel` a multiple of the group's
    size), or None on every rank when they cannot share one. A collective: every rank of the group calls it."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nbytes = size * numel * dtype.itemsize
    name = [f"trainyard-grads-{os.getpid()}-{secrets.token_hex(8)}" if rank == 0 else None]
    dist.broadcast_object_list(name, group_src=0, group=group)
    path, token = SHM_DIR / str(name[0]), str(name[0]).encode()
    if rank == 0:
        _create(path, nbytes, token)
    dist.barrier(group=group)
    mapped = _map(path, nbytes, token)
    everyone: list[bool | None] = [None] * size
    dist.all_gather_object(everyone, mapped is not None, group=group)
    if rank == 0:
        path.unlink(missing_ok=True)
    if mapped is None or not all(everyone):
        return None
    rows = torch.frombuffer(mapped, dtype=dtype).view(size, numel)  # the tensor keeps the mapping alive
    rows[rank].zero_()  # rank 0's row held the token, which every rank has read (they said so above)
    return rows


def sum_rows(rows: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Every row becomes the sum of the rows: this rank sums its slice of the columns (a collective: every rank of
    `group` calls it with the same rows)."""
    size, numel = rows.shape
    rank, per_rank = dist.get_rank(group), numel // size
    dist.barrier(group=group)  # every row is final
    part = rows[:, rank * per_rank:(rank + 1) * per_rank]
    part.copy_(part.sum(0).expand_as(part))
    dist.barrier(group=group)  # every slice is summed


def _create(path: Path, nbytes: int, token: bytes) -> None:
    try:
        if shutil.disk_usage(SHM_DIR).free < HEADROOM * nbytes:
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # no /dev/shm (macOS), or not writable: the others will not find the file
        return
    try:
        # Every page taken now (ENOSPC here, not a SIGBUS at a later write when others have filled /dev/shm).
        os.posix_fallocate(fd, 0, nbytes)
        os.pwrite(fd, token, 0)
    except OSError:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _map(path: Path, nbytes: int, token: bytes) -> mmap.mmap | None:
    """The file mapped shared, if it is there, as large as asked and starting with the token."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != nbytes or os.pread(fd, len(token), 0) != token:
            return None
        return mmap.mmap(fd, nbytes)
    except OSError:
        return None
    finally:
        os.close(fd)
