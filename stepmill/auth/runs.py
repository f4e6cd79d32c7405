"""Runs the rollout runner registered, as the event loop checks them: per-run credentials.

The runner registers each run (trajectory, group, channel) with a fresh secret and hands the agent
credentials that carry it. For a registered trajectory, only a credential (proxy user-info or a
tagged reverse path) with its secret may write; tag headers never override a credential; a
trajectory nobody registered may not join a registered group. A run's credentials are revoked when it
ends (completed, failed, timed out or cancelled): from then on they write nothing. Everything else is tagged as before
(``stepmill.tags``). Lookups are dictionary reads and one SHA-256 of a short secret: cheap enough for
the loop. The table is filled by the control API in this process and, for runs registered through
another proxy on the same file, by a thread that reads new rows off the loop.

A sandboxed run's door is known by a key, never by an address: the runner's side of the door adds
it (``DOOR_HEADER``) to the first request of each connection it carries, and the run never sees it.
The connection is then bound to the run (``bind``): every later request on it is the run's, found
with one dictionary read. Such a run's secret admits nothing on its own: a call that names it but came
through no door is refused as any caller from no door is (``resolve``).
"""

from __future__ import annotations

import dataclasses
import functools
import urllib.parse
from dataclasses import dataclass

from stepmill.auth.secret_hashes import secret_hash, secret_matches
from stepmill.tags import Tags

DOOR_HEADER = "X-Stepmill-Door"
DEFAULT_PORTS = (443, 80)  # what a host named without a port may be reached on


class Refused(Exception):
    """A call that may not be recorded as tagged: answered 403, never written."""


@dataclass(frozen=True)
class RegisteredRun:
    """A run the runner registered with the proxy: whose calls its secret (or its door) admits, and
    where they are recorded. (The runner's settings are ``RolloutSettings``; one agent's run is
    ``stepmill.runner.agent_run``.)"""

    trajectory_id: str
    group_id: str | None
    channel: str | None
    secret_hash: str
    rowid: int = 0  # its registration's row: a later one replaces it, an older one never does
    revoked: bool = False  # the run ended: its secret no longer writes (its trajectory stays registered)
    door: str | None = None  # the hash of a sandboxed run's door key: every call carrying the key is this run's
    hosts: tuple = ()  # where a run at a door may reach through the proxy (host:port, or host on 443 and 80)

    @functools.cached_property
    def reach(self) -> frozenset:
        """``hosts`` as (host, port) pairs, what the door's check compares: parsed once per registration
        (no field: a run goes to sibling workers as its fields)."""
        return frozenset(pair for entry in self.hosts for pair in host_ports(entry))

    def admits(self, secret: str | None) -> bool:
        return not self.revoked and secret_matches(secret, self.secret_hash)


class RunTable:
    def __init__(self):
        self.runs: dict[str, RegisteredRun] = {}
        self.groups: set[str] = set()
        self.doors: dict[str, str] = {}  # door key hash -> the trajectory of the run behind it
        self.open_doors: set[str] = set()  # trajectories of sandboxed runs not yet ended
        self.bound: dict[str, str] = {}  # client connection id -> the trajectory whose door key it carried

    def add(self, run: RegisteredRun) -> None:
        known = self.runs.get(run.trajectory_id)
        if known is not None and known.rowid > run.rowid:
            return  # read late from the file: the newer registration (a rerun's secret) stands
        if known is not None and known.door and self.doors.get(known.door) == run.trajectory_id:
            del self.doors[known.door]
        if isinstance(run.hosts, list):  # read from JSON (the file, a sibling)
            run = dataclasses.replace(run, hosts=tuple(run.hosts))
        self.runs[run.trajectory_id] = run
        if run.door:
            self.doors[run.door] = run.trajectory_id
        if run.door and not run.revoked:
            self.open_doors.add(run.trajectory_id)
        else:
            self.open_doors.discard(run.trajectory_id)
        if run.group_id:
            self.groups.add(run.group_id)

    def bind(self, connection: str, key: str) -> RegisteredRun | None:
        """The run whose door key a connection's first request carried, bound to the connection from
        now on; None for a key no run holds (nothing is bound)."""
        trajectory = self.doors.get(secret_hash(key.strip()))
        if trajectory is None:
            return None
        self.bound[connection] = trajectory
        return self.runs.get(trajectory)

    def at_door(self, connection: str) -> RegisteredRun | None:
        """The run a client connection is bound to, or None (not a sandboxed run's): one dictionary read."""
        trajectory = self.bound.get(connection)
        return self.runs.get(trajectory) if trajectory is not None else None

    def unbind(self, connection: str) -> None:
        self.bound.pop(connection, None)

    @staticmethod
    def through_door(run: RegisteredRun, credentials: tuple, headers: Tags | None) -> Tags:
        """A call from a run's door is that run's, whatever it says: it may name no other trajectory (a
        tagged path, credentials of another run or of one nobody registered; tag headers too when no
        credential is given) nor another group, and it writes nothing once the run ended. Its secret is
        not needed: the door key its connection carried says who sent it."""
        if run.revoked:
            raise Refused(f"run {run.trajectory_id!r} has ended: its credentials were revoked")
        named = [(tags.trajectory_id, None) for tags in credentials if tags is not None and tags.trajectory_id]
        if not named and headers is not None:  # as without a door: headers never override credentials
            named = [(headers.trajectory_id, headers.group_id)]
        for trajectory, group in named:  # (a credential's password is its secret, or else a group: not checked)
            for what, given, own in (("trajectory", trajectory, run.trajectory_id), ("group", group, run.group_id)):
                if given and given != own:
                    raise Refused(f"this call came through the door of run {run.trajectory_id!r}: it may write to "
                                  f"that run's trajectory alone, not to {what} {given!r}")
        return Tags(run.trajectory_id, run.group_id, run.channel)

    def credential(self, *sources: Tags | None) -> Tags | None:
        """The one credential of a call (a tagged path, the connection's or the request's proxy
        credentials, first given first). Once any of them names a registered run, none may name
        another trajectory: a run cannot write beside its own trajectory through a second source."""
        given = [tags for tags in sources if tags is not None and tags.trajectory_id]
        registered = [tags for tags in given if tags.trajectory_id in self.runs]
        if not registered:
            return given[0] if given else None
        chosen = registered[0]
        others = {tags.trajectory_id for tags in given} - {chosen.trajectory_id}
        if others:
            raise Refused(f"the credentials of registered run {chosen.trajectory_id!r} come with another "
                          f"trajectory ({', '.join(sorted(map(repr, others)))}) in the same call")
        run = self.runs[chosen.trajectory_id]
        return next((tags for tags in registered if run.admits(tags.secret)), chosen)

    def resolve(self, credential: Tags | None, headers: Tags | None, *, vouched: bool = False) -> Tags:
        """The tags a call that came through no run's door is recorded under, or Refused with the
        reason. While sandboxed runs are open, such a call needs a registered run's credentials, or
        ``vouched``: the write token came with it (whoever holds it may write anything anyway)."""
        if credential is not None and credential.trajectory_id in self.runs:
            run = self.runs[credential.trajectory_id]
            if run.door and not run.revoked:
                raise self._doorless()  # a sandboxed run writes through its door alone: its secret, lent, is no one's
            if run.revoked:
                raise Refused(f"run {run.trajectory_id!r} has ended: its credentials were revoked")
            if not run.admits(credential.secret):
                raise Refused(f"trajectory {run.trajectory_id!r} is a registered run: its credentials carry "
                              f"a secret this request {'gets wrong' if credential.secret else 'lacks'}")
            return Tags(run.trajectory_id, run.group_id, run.channel)  # headers never override
        if self.open_doors and not vouched:
            raise self._doorless()
        tags = (credential or Tags()).merge(headers)
        tags.secret = None
        if tags.trajectory_id in self.runs:
            raise Refused(f"trajectory {tags.trajectory_id!r} is a registered run: only its own credentials "
                          f"(with its secret) may write to it, not tag headers")
        if tags.group_id in self.groups:
            raise Refused(f"group {tags.group_id!r} belongs to registered runs: trajectory "
                          f"{tags.trajectory_id!r} is not one of them")
        return tags


    def _doorless(self) -> Refused:
        """What a call from no run's door is told while sandboxed runs are open: the same whoever it
        names, so a borrowed secret learns nothing an unknown caller would not."""
        return Refused(f"{len(self.open_doors)} sandboxed run(s) of a rollout are open: a call that comes through "
                       f"no run's door needs a registered run's credentials or the write token (X-Stepmill-Token)")


def host_ports(entry: str) -> list[tuple[str, int]]:
    """(host, port) pairs a ``host[:port]`` entry names, the host as a URL's (lower case, IPv6
    without brackets): a given port alone, else the default ones."""
    try:
        parts = urllib.parse.urlsplit(f"//{entry.strip()}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return []
    if not host:
        return []
    return [(host.rstrip("."), port)] if port else [(host.rstrip("."), default) for default in DEFAULT_PORTS]


def destination(host: str, port: int) -> tuple[str, int]:
    """Where a connection goes, as ``host_ports`` writes it."""
    return host.lower().strip("[]").rstrip("."), port
