"""How the rollout runner keeps each agent run away from everything that could change its own data.

The agents we record are the policies being trained, and they run shell commands: whatever a run
can reach, a policy will eventually use to reach its reward. ``[isolation] mode`` chooses how runs
are kept apart, one module per mode, each with the same interface (``policy.py``: what the run sees,
how it is started, how it ends); the README's threat model says what each one stops:

- ``sandbox`` (``sandbox.py``): bubblewrap, an unprivileged uid in a user namespace of its own,
  files by allow-list (``files.py``), its own PID, IPC, UTS and network namespaces.
- ``user`` (``user.py``): another OS user per concurrent run (the runner must be root).
- ``container`` (``container.py``): a container command of the configuration's runs the agent.
- ``none`` (``host.py``): the agent runs as the runner does and can read and change its own data.
- ``auto`` (the default): ``sandbox`` where bubblewrap works, else ``none``.

Whatever the mode, a run's environment is built by allow-list (``environment.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from stepmill.errors import ConfigError
from stepmill.runner.isolation.environment import agent_environment, check_pass_env
from stepmill.runner.isolation.files import Exposed, Private, code_paths, exposed
from stepmill.runner.isolation.policy import Policy, RunPlace
from stepmill.runner.isolation.sandbox import bwrap_problem
from stepmill.runner.isolation.uids import UidLeases
from stepmill.runner.limits import Limits

# Each mode's module (its ``POLICY`` class): a new mode is a new module and its line here.
MODULES = {"sandbox": "sandbox", "user": "user", "container": "container", "none": "host"}
MODES = ("auto", *MODULES)
__all__ = ["MODES", "Exposed", "Isolation", "IsolationError", "Policy", "Private", "RunPlace", "agent_environment",
           "UidLeases", "bwrap_problem", "code_paths", "policy", "resolve"]


class IsolationError(ConfigError):
    """The isolation asked for cannot be had here; the message says why and what to do."""


@dataclass
class Isolation:
    mode: str = "auto"
    first_uid: int = 61000  # user mode, and a root runner's sandbox: the uids runs are leased start here (uids.py)
    prefix: list = field(default_factory=list)  # container mode
    # sandbox: more the runs see: "/path" (read-only) or { path = "/path", writable = true }
    expose: list = field(default_factory=list)
    # sandbox: "own" (a network namespace whose only way out is the run's door to the proxy) or "host"
    network: str = "own"
    # sandbox, network = "own": hosts (host or host:port) a run may reach through the proxy besides LLM
    # calls (the configured LLM's host is always one), e.g. a package index a task needs
    allow_hosts: list = field(default_factory=list)
    # more of the runner's environment a run gets ("NAME" or "PREFIX_*"), beyond PATH, HOME, LANG, TERM
    pass_env: list = field(default_factory=list)
    # processes, memory, CPU time, file size and output log of each run (limits.py)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        self.expose = [exposed(item) for item in self.expose]
        if isinstance(self.limits, dict):
            unknown = set(self.limits) - set(Limits.__dataclass_fields__)
            if unknown:
                raise ConfigError(f"[isolation] limits: unknown {', '.join(sorted(unknown))}; "
                                  f"known: {', '.join(Limits.__dataclass_fields__)}")
            self.limits = Limits(**self.limits)
        if self.network not in ("own", "host"):
            raise ConfigError(f"[isolation] network must be \"own\" or \"host\", not {self.network!r}")
        if not (isinstance(self.allow_hosts, list) and all(isinstance(h, str) and h for h in self.allow_hosts)):
            raise ConfigError("[isolation] allow_hosts must be a list of host or host:port strings")
        check_pass_env(self.pass_env)


def resolve(isolation: Isolation) -> str:
    """The mode runs will use; IsolationError when the one asked for cannot be had."""
    mode = isolation.mode
    if mode == "auto":
        if bwrap_problem() is None:
            return "sandbox"
        if os.geteuid() == 0:  # none would make each run root on the host: only where asked for by name
            raise IsolationError(f"isolation = auto: runs cannot be sandboxed here ({bwrap_problem()}), and the "
                                 f"runner is root, so a run of mode none would be root on the host; make bubblewrap "
                                 f"work, or choose [isolation] mode = \"user\" (each run another uid) or \"none\"")
        return "none"
    if mode == "sandbox" and bwrap_problem() is not None:
        raise IsolationError(f"isolation = sandbox: {bwrap_problem()}")
    if mode == "user" and os.geteuid() != 0:
        raise IsolationError("isolation = user: the runner must run as root to start runs as other users")
    if mode == "container" and not isolation.prefix:
        raise IsolationError("isolation = container needs prefix, the container command to run agents in")
    return mode


def check_user_mode(dataset: str) -> None:
    from stepmill.runner.isolation.user import check_dataset

    problem = check_dataset(dataset)
    if problem:
        raise IsolationError(problem)


def check_reachable(runs_root) -> None:
    from stepmill.runner.isolation.user import unreachable

    problem = unreachable(runs_root)
    if problem:
        raise IsolationError(problem)


def policy(mode: str, isolation: Isolation, private: Private) -> Policy:
    """The rules of ``mode`` (a resolved one) for a rollout's runs: its module's ``POLICY``."""
    import importlib

    module = importlib.import_module(f"stepmill.runner.isolation.{MODULES[mode]}")
    return module.POLICY(isolation, private)
