"""Runs the rollout runner registered, as the event loop checks them: per-run credentials.

The runner registers each run (trajectory, group, channel) with a fresh secret and hands the agent
credentials that carry it. For a registered trajectory, only a credential (proxy user-info or a
tagged reverse path) with its secret may write; tag headers never override a credential; a
trajectory nobody registered may not join a registered group. Everything else is tagged as before
(``stepmill.tags``). Lookups are dictionary reads and one SHA-256 of a short secret: cheap enough for
the loop. The table is filled by the control API in this process and, for runs registered through
another proxy on the same file, by a thread that reads new rows off the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepmill.auth.secret_hashes import secret_matches
from stepmill.tags import Tags


class Refused(Exception):
    """A call that may not be recorded as tagged: answered 403, never written."""


@dataclass(frozen=True)
class Run:
    trajectory_id: str
    group_id: str | None
    channel: str | None
    secret_hash: str
    rowid: int = 0  # its registration's row: a later one replaces it, an older one never does

    def admits(self, secret: str | None) -> bool:
        return secret_matches(secret, self.secret_hash)


class RunTable:
    def __init__(self):
        self.runs: dict[str, Run] = {}
        self.groups: set[str] = set()

    def add(self, run: Run) -> None:
        known = self.runs.get(run.trajectory_id)
        if known is not None and known.rowid > run.rowid:
            return  # read late from the file: the newer registration (a rerun's secret) stands
        self.runs[run.trajectory_id] = run
        if run.group_id:
            self.groups.add(run.group_id)

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

    def resolve(self, credential: Tags | None, headers: Tags | None) -> Tags:
        """The tags a call is recorded under, or Refused with the reason."""
        if credential is not None and credential.trajectory_id in self.runs:
            run = self.runs[credential.trajectory_id]
            if not run.admits(credential.secret):
                raise Refused(f"trajectory {run.trajectory_id!r} is a registered run: its credentials carry "
                              f"a secret this request {'gets wrong' if credential.secret else 'lacks'}")
            return Tags(run.trajectory_id, run.group_id, run.channel)  # headers never override
        tags = (credential or Tags()).merge(headers)
        tags.secret = None
        if tags.trajectory_id in self.runs:
            raise Refused(f"trajectory {tags.trajectory_id!r} is a registered run: only its own credentials "
                          f"(with its secret) may write to it, not tag headers")
        if tags.group_id in self.groups:
            raise Refused(f"group {tags.group_id!r} belongs to registered runs: trajectory "
                          f"{tags.trajectory_id!r} is not one of them")
        return tags
