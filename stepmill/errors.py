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


class PluginError(ConfigError):
    """An installed plugin (an entry point another package registers) that cannot be used: the message
    names the entry point and what is wrong with it."""


class StoreUnavailable(StepmillError):
    """The database cannot be opened or written now (missing, locked, full, read-only, too new)."""

    status = 503


class SyncError(StepmillError):
    """An engine that does not serve the policy it was handed: a reload that failed, or a probe whose
    logprobs differ from the trainer's (the message says the version and the gap; so do ``version`` and
    ``gap``, None where a step failed before any probe)."""

    status = 502

    def __init__(self, message: str, *, version: str | None = None, gap: float | None = None):
        super().__init__(message)
        self.version, self.gap = version, gap
