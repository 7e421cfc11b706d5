"""Byte counts as people read them, in binary units: one table for the plan's messages and the CLI.

Pure, and importing nothing, so the CLI can use it without loading the plan.
"""

from __future__ import annotations

UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def byte_unit(nbytes: float) -> tuple[int, str]:
    """The binary unit a byte count reads best in (GiB from 1 GiB up, MiB below, KiB under a MiB)."""
    for div, unit in UNITS:
        if nbytes >= div:
            return div, unit
    return UNITS[-1]


def format_size(nbytes: float) -> str:
    """Three significant digits (whole units from 1000 up): `1.5 GiB`, `640 MiB`, `1,024 GiB`."""
    div, unit = byte_unit(nbytes)
    return f"{nbytes / div:,.3g} {unit}" if nbytes < 1000 * div else f"{nbytes / div:,.0f} {unit}"


def format_bytes(nbytes: float) -> str:
    """One decimal in the unit it reads best in, plain bytes under a KiB: `1.5 GiB`, `12.0 KiB`, `512 B`
    (the CLI's tables)."""
    if nbytes < UNITS[-1][0]:
        return f"{nbytes:g} B"
    div, unit = byte_unit(nbytes)
    return f"{nbytes / div:.1f} {unit}"
