"""A run's environment, by allow-list: of the runner's own variables a run gets ``PATH``, ``HOME``
(replaced by a home of its own where the mode gives one), ``LANG`` and ``TERM``, and what
``[isolation] pass_env`` names; then the recipe's ``env`` and the variables stepmill sets. Nothing else
of the runner's shell reaches it: not an API key (``OPENAI_API_KEY``, ``HF_TOKEN``, ``AWS_*``), not a
service's address or socket, not stepmill's own settings."""

from __future__ import annotations

from stepmill.errors import ConfigError

ALWAYS = ("PATH", "HOME", "LANG", "TERM")


def check_pass_env(names) -> list[str]:
    """``[isolation] pass_env``: variable names, or prefixes ending in ``*`` (``"CUDA_*"``); never
    stepmill's own (``STEPMILL_*``), which it sets itself or keeps from runs."""
    if not (isinstance(names, list) and all(isinstance(n, str) and n and n.rstrip("*") for n in names)):
        raise ConfigError('[isolation] pass_env must be a list of variable names (or prefixes like "CUDA_*")')
    for name in names:
        if name.upper().startswith("STEPMILL_"):
            raise ConfigError(f"[isolation] pass_env: {name!r}: stepmill's own variables are never passed on")
    return names


def agent_environment(environ: dict, pass_env: list[str] = ()) -> dict:
    """What of the runner's environment a run inherits (before the recipe's and stepmill's own)."""
    exact = set(ALWAYS) | {name for name in pass_env if not name.endswith("*")}
    prefixes = tuple(name[:-1] for name in pass_env if name.endswith("*"))
    return {k: v for k, v in environ.items()
            if (k in exact or (prefixes and k.startswith(prefixes))) and not k.upper().startswith("STEPMILL_")}
