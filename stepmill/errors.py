"""The errors stepmill explains, by what went wrong rather than where.

The control API answers each with its ``status``; the CLI prints its message and exits 1. Code
that means "not found" raises ``NotFound``, never a bare ``KeyError``: a ``KeyError`` is a bug and
stays a 500.
"""

from __future__ import annotations


class StepmillError(Exception):
    """A problem stepmill can say in one sentence; ``str()`` is that sentence."""

    status = 500


class BadInput(StepmillError, ValueError):
    """A request, record or argument that is not acceptable as given."""

    status = 400


class NotFound(StepmillError, LookupError):
    """A step, trajectory, group or other target that does not exist."""

    status = 404


class Conflict(StepmillError):
    """A request that clashes with what is already there (an id taken, a claim held by another)."""

    status = 409


class ConfigError(StepmillError, ValueError):
    """A configuration (rollout, rewards, isolation, options) that cannot be used as written."""

    status = 400


class StoreUnavailable(StepmillError):
    """The database cannot be opened or written now (missing, locked, full, read-only, too new)."""

    status = 503
