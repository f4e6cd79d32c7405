"""Consumption: which groups a trainer has claimed and acknowledged (the ``consumption`` table)."""

from __future__ import annotations


class Consumption:
    """Claims with leases and acks that take effect once; a part of ``Store``."""
