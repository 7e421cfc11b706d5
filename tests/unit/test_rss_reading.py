"""What a rank reports of its memory (`actors.worker_group.worker`): `peak_rss_bytes` is the process's high-water mark
as the OS keeps it (VmHWM), which outlives what the process freed; `resident_bytes` reads /proc/self/status."""

from pathlib import Path

import pytest
from trainyard.actors.worker_group.worker import peak_rss_bytes
from trainyard.parallel.runtime.host_memory import resident_bytes


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc only")
def test_the_peak_is_vmhwm_and_keeps_what_was_freed():
    before = resident_bytes("VmRSS")
    assert before is not None and before > 0
    block = b"\x01" * (64 << 20)  # written, so resident
    del block
    peak = peak_rss_bytes()
    assert peak >= before + (48 << 20)  # the freed block still counts (the kernel syncs its counters lazily)
    hwm = resident_bytes("VmHWM")
    assert hwm is not None and peak <= hwm  # the mark only rises
    assert resident_bytes("NoSuchField") is None
