"""bench.checkpoint's pure helpers: the slower rank's times, a checkpoint's bytes, `df -T`'s filesystem."""

from __future__ import annotations

import os
from pathlib import Path

from trainyard.parallel.spec import parse_spec

from bench.checkpoint import SPEC, dir_bytes, drop_page_cache, parse_df, slower, slower_steps


def test_spec_is_a_dp2_job_that_keeps_two_checkpoints():
    cfg = parse_spec(SPEC)
    assert cfg.parallel.dp == 2 and cfg.checkpoint.keep == 2


def test_a_round_takes_the_slower_rank_and_skips_ranks_that_did_not_time_it():
    records = [[{"sync_s": 1.0, "verify_s": 0.3}, {"sync_s": 2.0, "verify_s": 0.4}],
               [{"sync_s": 1.5, "verify_s": None}, {"sync_s": 1.0, "verify_s": None}]]
    assert slower(records, "sync_s") == [1.5, 2.0]
    assert slower(records, "verify_s") == [0.3, 0.4]


def test_step_times_are_the_slower_rank_step_by_step():
    records = [[{"steps": [1.0, 3.0]}], [{"steps": [2.0, 1.0]}]]
    assert slower_steps(records, "steps") == [[2.0, 3.0]]


def test_checkpoint_bytes_are_the_sum_of_its_files(tmp_path: Path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 1000)
    (tmp_path / ".metadata").write_bytes(b"y" * 24)
    (tmp_path / "sub").mkdir()
    assert dir_bytes(tmp_path) == 1024


def test_dropping_the_page_cache_advises_the_kernel_for_every_file_and_skips_folders(tmp_path: Path, monkeypatch):
    for name in ("a.distcp", "b.distcp", ".metadata"):
        (tmp_path / name).write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    advised: list[tuple[str, int, int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    drop_page_cache(tmp_path)
    # the whole of each file (offset 0, length 0 = to the end), told its pages are not needed
    assert sorted(advised) == [(str(tmp_path / n), 0, 0, os.POSIX_FADV_DONTNEED)
                               for n in (".metadata", "a.distcp", "b.distcp")]


def test_filesystem_is_read_from_the_last_line_of_df():
    out = ("Filesystem     Type 1K-blocks     Used Available Use% Mounted on\n"
           "/dev/vda       ext4 264212084 26034592  80356320  25% /\n")
    assert parse_df(out) == "ext4 on /dev/vda (mounted at /)"
    assert parse_df("garbage") == parse_df("") == "unknown"
