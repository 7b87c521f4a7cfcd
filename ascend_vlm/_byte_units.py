"""Byte units the package's options and reports count in."""

from __future__ import annotations

# A mebibyte: the unit of every ``--...-mib`` option and of the MiB figures reports print.
MIB = 1 << 20
