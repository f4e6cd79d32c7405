"""The fleet's ledger, its coordinator: a registry, group readiness, leases and the policy version, in PostgreSQL.

The fleet's modules (``stepmill.fleet``: nodes, the remote consumer, Ray rollouts) use it through
``Coordinator``; its tables and queries are here, in the store, as every SQL of stepmill is.

Which side holds what. Step records (messages, tokens, rewards, reviews) stay in each node's
SQLite file, written by that node's proxy exactly as on one machine; a node serves them with
``stepmill serve``. The coordinator holds only what the fleet must agree on:

- the registry: nodes (id, serve URL, last heartbeat), groups (channel, expected number of runs)
  and runs (the trajectory ids), each run on the node whose file holds its steps;
- readiness: the runner or node reports each run finished, committed (its steps are in the node's
  file) and scored; a group is ready when it has its expected number of runs and every one is all three;
- claims: a ready group is leased to one consumer at a time (``SELECT ... FOR UPDATE SKIP LOCKED``,
  the pattern pgmq implements); a lease that runs out returns the group; an ack takes effect once, and
  ``ack_many`` acknowledges several groups (one optimizer step's) in one transaction, all or none;
- the fleet-wide policy version and the staleness allowed: a ready group whose oldest policy version
  is older than the current by more than ``max_staleness`` is set aside as ``stale``, never handed
  out (the rule one machine's consumer applies to its file: both versions integers, else never stale).

A claim answers ``GroupLease``s (a lease on a group held by a consumer); each names the nodes that hold
its runs, and the consumer fetches the steps from them.

What is durable when. Every method is one PostgreSQL transaction and is durable when it returns
(the server's commit). Times (heartbeats, leases) are the server's clock, ``now()``, so the
clocks of the nodes and trainers never matter. When the connection drops (PostgreSQL restarted,
a network cut) a call reconnects and tries again for up to ``retry_s`` seconds, then raises
``StoreUnavailable``. Trying again is safe: registering, reporting, heartbeats, acks and releases
are idempotent; a claim whose reply was lost after its commit leaves a lease nobody holds, which
runs out and returns the group, so no group is ever held by two consumers at once.

Calls block (one round trip or a few): they belong to the runner, ``stepmill serve``, trainers and
heartbeat threads, never to the proxy's event loop.

A node that stops heartbeating for ``node_timeout_s`` keeps its groups: they are not handed out
(their steps are on that node) and ``lost_groups()`` reports each with the node and the reason.
When the node heartbeats again they are handed out as before.

    fleet = Coordinator("postgresql://stepmill@db-host/stepmill")   # or STEPMILL_COORDINATOR
    fleet.register_node("node-a", "http://10.0.0.5:8780")
    fleet.register_group("g1", size=8)
    fleet.register_run("t1", group_id="g1", node_id="node-a")
    fleet.report("t1", finished=True, committed=True, scored=True)
    claims = fleet.claim("trainer-0", n=4, lease_seconds=600)
    ...  # fetch each claim's runs from claim.nodes, train on them
    fleet.ack_many(claims)
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

from stepmill.errors import BadInput, ConfigError, Conflict, NotFound, StoreUnavailable

try:
    import psycopg
    from psycopg.rows import dict_row
except ImportError:  # the coordinator is optional: stepmill on one machine never needs it
    psycopg = None

ENV = "STEPMILL_COORDINATOR"
SCHEMES = ("postgresql", "postgres")
MAX_ID = 256
DEFAULT_NODE_TIMEOUT = 120.0
INT64 = (-(1 << 63), (1 << 63) - 1)
# One advisory lock key for migrations, so two processes connecting first at once apply them once.
MIGRATION_LOCK = 0x5374_6570_6D69_6C6C & INT64[1]

T = TypeVar("T")

# Ordered schema migrations, all in the schema ``stepmill``. Append new ones; never edit one that has shipped.
MIGRATIONS: list[tuple[str, list[str]]] = [
    ("registry_and_claims", [
        """CREATE TABLE stepmill.nodes (
             id text PRIMARY KEY, serve_url text NOT NULL,
             registered_at timestamptz NOT NULL DEFAULT now(), heartbeat_at timestamptz NOT NULL DEFAULT now())""",
        # state: open (not handed out; ready when ready_at is set) | leased | acked | stale.
        # lease_id stays on an acked group so that the holder's repeated ack is recognised.
        """CREATE TABLE stepmill.groups (
             id text PRIMARY KEY, channel text NOT NULL, size integer NOT NULL CHECK (size > 0),
             registered_at timestamptz NOT NULL DEFAULT now(), ready_at timestamptz, oldest_version bigint,
             state text NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'leased', 'acked', 'stale')),
             lease_id bigint, consumer text, lease_until timestamptz, acked_at timestamptz)""",
        "CREATE INDEX groups_claimable ON stepmill.groups (ready_at) WHERE state IN ('open', 'leased')",
        """CREATE TABLE stepmill.runs (
             id text PRIMARY KEY, group_id text NOT NULL REFERENCES stepmill.groups (id),
             node_id text NOT NULL REFERENCES stepmill.nodes (id), registered_at timestamptz NOT NULL DEFAULT now(),
             finished boolean NOT NULL DEFAULT false, committed boolean NOT NULL DEFAULT false,
             scored boolean NOT NULL DEFAULT false, policy_version text, oldest_version bigint)""",
        "CREATE INDEX runs_group ON stepmill.runs (group_id)",
        "CREATE INDEX runs_node ON stepmill.runs (node_id)",
        # Every lease ever given: how it ended (acked | released | expired) is the group's history.
        """CREATE TABLE stepmill.leases (
             id bigserial PRIMARY KEY, group_id text NOT NULL REFERENCES stepmill.groups (id),
             consumer text NOT NULL, claimed_at timestamptz NOT NULL DEFAULT now(), lease_until timestamptz NOT NULL,
             ended text CHECK (ended IN ('acked', 'released', 'expired')), ended_at timestamptz)""",
        "CREATE INDEX leases_group ON stepmill.leases (group_id)",
        "CREATE TABLE stepmill.settings (key text PRIMARY KEY, value text)",
    ]),
    # How far behind the fleet's policy each group was when claimed (NULL: versions not integers).
    ("lease_staleness", [
        "ALTER TABLE stepmill.leases ADD COLUMN policy_version text, ADD COLUMN staleness bigint",
    ]),
    # What happened to each node's processes and runs (a proxy that died and was restarted, a run run again),
    # and a node whose proxy could not come back: ``lost`` says why; it takes no more runs.
    ("node_events", [
        """CREATE TABLE stepmill.node_events (
             id bigserial PRIMARY KEY, node_id text NOT NULL REFERENCES stepmill.nodes (id),
             at timestamptz NOT NULL DEFAULT now(), kind text NOT NULL, run_id text, detail text NOT NULL DEFAULT '')""",
        "CREATE INDEX node_events_node ON stepmill.node_events (node_id, id)",
        "ALTER TABLE stepmill.nodes ADD COLUMN lost text",
    ]),
]
# What a node event says happened (``Coordinator.node_event``).
NODE_EVENTS = ("proxy_died", "proxy_restarted", "proxy_lost", "serve_died", "serve_restarted", "serve_stopped",
               "serve_kept", "serve_not_kept", "rerun", "moved")


@dataclass
class GroupLease:
    """A group leased to one consumer until ``lease_until`` (seconds since the epoch, the server's clock)."""

    group_id: str
    channel: str
    consumer: str
    lease_id: int
    lease_until: float
    policy_version: str | None  # the oldest integer policy version among its runs
    runs: dict[str, str] = field(default_factory=dict)  # run (trajectory) id -> node id
    nodes: dict[str, str] = field(default_factory=dict)  # node id -> its serve URL
    staleness: int | None = None  # the fleet's policy version at the claim minus policy_version (None: not integers)


@dataclass
class LostGroup:
    """A group not acknowledged whose steps (some of them) are on a node that stopped heartbeating."""

    group_id: str
    state: str
    node_id: str
    serve_url: str
    last_heartbeat: float
    reason: str


def redacted(url: str) -> str:
    """The URL with its password (in the user part or a ``password=`` parameter) shown as ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that cannot be parsed)"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if colon else f"{user}@{hostport}"
    query = "&".join("password=***" if unquote(item.partition("=")[0]).strip().lower() == "password" else item
                     for item in parts.query.split("&")) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _passwords(url: str) -> list[str]:
    """Every form the URL's password could take in a message (raw and decoded), longest first."""
    found = set()
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    userinfo = parts.netloc.rpartition("@")[0]
    if ":" in userinfo:
        found.add(userinfo.partition(":")[2])
    for item in parts.query.split("&"):
        key, _, value = item.partition("=")
        if unquote(key).strip().lower() == "password":
            found.add(value)
    found |= {unquote(p) for p in found}
    return sorted((p for p in found if p), key=len, reverse=True)


def _scrubbed(message: str, url: str) -> str:
    for password in _passwords(url):
        message = message.replace(password, "***")
    return message


def _checked_url(url: str | None) -> str:
    url = url or os.environ.get(ENV, "")
    if not url:
        raise ConfigError(f"no coordinator: pass a postgresql:// URL or set {ENV}")
    try:
        scheme = urlsplit(url).scheme
    except ValueError:
        scheme = ""
    if scheme not in SCHEMES:
        raise BadInput("the coordinator's address must be a postgresql://user@host:port/database URL")
    return url


def _id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID or "\x00" in value:
        raise BadInput(f"{what} must be a non-empty string of at most {MAX_ID} characters, got {value!r:.80}")
    return value


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 10**8:
        raise BadInput(f"{what} must be a positive number of seconds, got {value!r:.40}")
    return float(value)


def version_number(version: Any) -> int | None:
    """A policy version as an integer, or None when it is not one (such versions are never stale)."""
    if version is None or isinstance(version, bool):
        return None
    try:
        number = int(str(version))
    except ValueError:
        return None
    return number if INT64[0] <= number <= INT64[1] else None


def _version_text(version: Any) -> str | None:
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, (str, int)) or not str(version) or "\x00" in str(version):
        raise BadInput(f"a policy version is a non-empty string or an integer, got {version!r:.40}")
    return str(version)


# A group that may be handed out now: ready, not held (or its lease ran out), on nodes that still heartbeat.
CLAIMABLE = """
SELECT g.id, g.channel, g.oldest_version, g.lease_id FROM stepmill.groups g
WHERE g.ready_at IS NOT NULL AND (g.state = 'open' OR (g.state = 'leased' AND g.lease_until < now()))
  AND (%(channel)s::text IS NULL OR g.channel = %(channel)s::text)
  AND NOT EXISTS (SELECT 1 FROM stepmill.runs r JOIN stepmill.nodes n ON n.id = r.node_id
                  WHERE r.group_id = g.id AND n.heartbeat_at < now() - %(timeout)s * interval '1 second')
ORDER BY g.ready_at, g.id
LIMIT %(limit)s
FOR UPDATE OF g SKIP LOCKED
"""

CLAIM_FIELDS = """g.id AS group_id, g.channel, g.consumer, g.lease_id,
  extract(epoch FROM g.lease_until)::float8 AS lease_until, g.oldest_version,
  (SELECT l.staleness FROM stepmill.leases l WHERE l.id = g.lease_id) AS staleness"""


class Coordinator:
    """One connection to the fleet's PostgreSQL; each method is one transaction (thread-safe, not fork-safe:
    each process opens its own)."""

    def __init__(self, url: str | None = None, *, node_timeout_s: float | None = None, retry_s: float = 15.0,
                 connect_timeout_s: int = 5):
        """``node_timeout_s``: how long a node may be silent before its groups count as lost; None: the
        fleet's setting (``set_node_timeout``), else 120 s."""
        if psycopg is None:
            raise ConfigError("the fleet's coordinator needs psycopg 3: pip install 'stepmill[fleet]'")
        self._url = _checked_url(url)
        self.node_timeout_s = DEFAULT_NODE_TIMEOUT if node_timeout_s is None else \
            _seconds(node_timeout_s, "node_timeout_s")
        self.retry_s = max(0.0, float(retry_s))
        self._connect_timeout = max(1, int(connect_timeout_s))
        self._conn = None
        self._migrated = False
        self.reconnects = 0  # connections lost and opened again (PostgreSQL restarted, a network cut)
        self._lock = threading.Lock()
        self._run(lambda cur: None)  # connect (and migrate) now: a wrong address shows at once
        if node_timeout_s is None and self._setting("node_timeout_s") is not None:
            self.node_timeout_s = float(self._setting("node_timeout_s"))

    @property
    def url(self) -> str:
        """The coordinator's URL with its password hidden (safe to print or log)."""
        return redacted(self._url)

    def __repr__(self) -> str:
        return f"Coordinator({self.url!r})"

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- connection -------------------------------------------------------------------------------------

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def _connection(self):
        if self._conn is None or self._conn.closed:
            # A connection cut without a word (a network partition) must end, not hang a lease renewal
            # behind the lock: TCP keepalives, a send timeout, and a bound on any one statement.
            self._conn = psycopg.connect(self._url, autocommit=True, connect_timeout=self._connect_timeout,
                                         application_name="stepmill-coordinator", keepalives=1,
                                         keepalives_idle=10, keepalives_interval=5, keepalives_count=3,
                                         tcp_user_timeout=30_000, options="-c statement_timeout=30000")
        if not self._migrated:
            migrate(self._conn)
            self._migrated = True
        return self._conn

    def _run(self, work: Callable[[Any], T]) -> T:
        """``work(cursor)`` in one transaction; on a lost connection, again on a new one until ``retry_s``."""
        deadline = time.monotonic() + self.retry_s
        pause = 0.05
        with self._lock:
            while True:
                try:
                    conn = self._connection()
                    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                        return work(cur)
                except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                    self._drop()
                    self.reconnects += 1
                    if time.monotonic() + pause > deadline:
                        reason = _scrubbed(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                                           self._url)
                        raise StoreUnavailable(f"the coordinator at {self.url} cannot be reached: {reason}") from None
                    time.sleep(pause)
                    pause = min(pause * 2, 1.0)

    # --- registry ---------------------------------------------------------------------------------------

    def register_node(self, node_id: str, serve_url: str) -> None:
        """Add a node (or give a known one its new serve URL); counts as a heartbeat."""
        _id(node_id, "a node id")
        if not isinstance(serve_url, str) or not serve_url.startswith(("http://", "https://")) or len(serve_url) > 2000:
            raise BadInput(f"a node's serve URL must be an http(s):// URL, got {serve_url!r:.80}")
        self._run(lambda cur: cur.execute(
            "INSERT INTO stepmill.nodes (id, serve_url) VALUES (%s, %s) ON CONFLICT (id) DO UPDATE"
            " SET serve_url = EXCLUDED.serve_url, heartbeat_at = now(), lost = NULL", [node_id, serve_url]))

    def heartbeat(self, node_id: str) -> None:
        _id(node_id, "a node id")

        def work(cur):
            if not cur.execute("UPDATE stepmill.nodes SET heartbeat_at = now() WHERE id = %s", [node_id]).rowcount:
                raise NotFound(f"no node {node_id!r} is registered with the coordinator")
        self._run(work)

    def nodes(self) -> list[dict]:
        """Every node: id, serve_url, last_heartbeat (epoch seconds), silent_s, alive, lost (why its proxy
        could not come back, None while it can take runs)."""
        rows = self._run(lambda cur: cur.execute(
            "SELECT id, serve_url, lost, extract(epoch FROM heartbeat_at)::float8 AS last_heartbeat,"
            " extract(epoch FROM now() - heartbeat_at)::float8 AS silent_s FROM stepmill.nodes ORDER BY id").fetchall())
        return [{**row, "alive": row["silent_s"] <= self.node_timeout_s} for row in rows]

    def node_event(self, node_id: str, kind: str, detail: str = "", *, run_id: str | None = None) -> None:
        """Record what happened on a node (``NODE_EVENTS``); ``proxy_lost`` also marks the node lost (its
        proxy could not be restarted: it takes no more runs) until it registers again."""
        _id(node_id, "a node id")
        if kind not in NODE_EVENTS:
            raise BadInput(f"a node event is one of {', '.join(NODE_EVENTS)}, not {kind!r:.40}")
        if run_id is not None:
            _id(run_id, "a run id")
        detail = str(detail)[:2000]

        def work(cur):
            if not cur.execute("SELECT 1 FROM stepmill.nodes WHERE id = %s", [node_id]).fetchone():
                raise NotFound(f"no node {node_id!r} is registered with the coordinator")
            cur.execute("INSERT INTO stepmill.node_events (node_id, kind, run_id, detail) VALUES (%s, %s, %s, %s)",
                        [node_id, kind, run_id, detail])
            if kind == "proxy_lost":
                cur.execute("UPDATE stepmill.nodes SET lost = %s WHERE id = %s", [detail or "lost", node_id])
        self._run(work)

    def node_events(self, node_id: str | None = None, *, limit: int = 100) -> list[dict]:
        """The latest ``limit`` node events (of one node, or of all), oldest first: id, node_id, at (epoch
        seconds), kind, run_id, detail."""
        if node_id is not None:
            _id(node_id, "a node id")
        rows = self._run(lambda cur: cur.execute(
            "SELECT id, node_id, extract(epoch FROM at)::float8 AS at, kind, run_id, detail FROM stepmill.node_events"
            " WHERE %s::text IS NULL OR node_id = %s ORDER BY id DESC LIMIT %s",
            [node_id, node_id, max(1, int(limit))]).fetchall())
        return rows[::-1]

    def move_group(self, group_id: str, node_id: str, reason: str) -> list[str]:
        """A group whose node was lost runs again on ``node_id``: its runs are registered there afresh (not
        finished, committed or scored) and a ``moved`` event names the reason. Only a group that was never
        ready can move (a ready one's steps were handed out as they are); returns the runs moved."""
        _id(group_id, "a group id")
        _id(node_id, "a node id")

        def work(cur):
            group = cur.execute("SELECT ready_at FROM stepmill.groups WHERE id = %s FOR UPDATE", [group_id]).fetchone()
            if group is None:
                raise NotFound(f"no group {group_id!r} is registered with the coordinator")
            if group["ready_at"] is not None:
                raise Conflict(f"group {group_id!r} is ready on its node already: it does not move")
            if not cur.execute("SELECT 1 FROM stepmill.nodes WHERE id = %s", [node_id]).fetchone():
                raise NotFound(f"no node {node_id!r} is registered with the coordinator")
            runs = [row["id"] for row in cur.execute(
                "UPDATE stepmill.runs SET node_id = %s, finished = false, committed = false, scored = false"
                " WHERE group_id = %s RETURNING id", [node_id, group_id]).fetchall()]
            cur.execute("INSERT INTO stepmill.node_events (node_id, kind, detail) VALUES (%s, 'moved', %s)",
                        [node_id, f"group {group_id} ({len(runs)} runs) moved here: {reason}"[:2000]])
            return sorted(runs)
        return self._run(work)

    def unconsumed(self, node_ids: list[str]) -> int:
        """How many groups with runs on these nodes are still to be consumed: waiting, ready or leased
        (acknowledged and stale groups are done with: a stale one is never handed out)."""
        for node_id in node_ids:
            _id(node_id, "a node id")
        return self._run(lambda cur: cur.execute(
            "SELECT count(DISTINCT g.id) AS n FROM stepmill.groups g JOIN stepmill.runs r ON r.group_id = g.id"
            " WHERE r.node_id = ANY(%s) AND g.state IN ('open', 'leased')", [list(node_ids)]).fetchone()["n"])

    def runs_to_report(self, node_id: str) -> list[str]:
        """Ids of the node's runs not yet reported finished, committed and scored (what a node still has to
        say about its file)."""
        _id(node_id, "a node id")
        return [row["id"] for row in self._run(lambda cur: cur.execute(
            "SELECT id FROM stepmill.runs WHERE node_id = %s AND NOT (finished AND committed AND scored) ORDER BY id",
            [node_id]).fetchall())]

    def register_group(self, group_id: str, size: int, *, channel: str = "train") -> None:
        """A group that is ready once it has ``size`` runs, all finished, committed and scored. Registering
        it again the same way does nothing; with another size or channel it is a Conflict."""
        _id(group_id, "a group id")
        _id(channel, "a channel")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size < 1 << 31:
            raise BadInput(f"a group's size must be a positive integer, got {size!r:.40}")

        def work(cur):
            cur.execute("INSERT INTO stepmill.groups (id, channel, size) VALUES (%s, %s, %s)"
                        " ON CONFLICT (id) DO NOTHING", [group_id, channel, size])
            row = cur.execute("SELECT channel, size FROM stepmill.groups WHERE id = %s", [group_id]).fetchone()
            if (row["channel"], row["size"]) != (channel, size):
                raise Conflict(f"group {group_id!r} is registered with {row['size']} runs on channel "
                               f"{row['channel']!r}, not {size} on {channel!r}")
        self._run(work)

    def register_run(self, run_id: str, *, group_id: str, node_id: str,
                     policy_version: str | int | None = None) -> None:
        """A run (its trajectory id) of a group, whose steps the node's file holds. Registering it again on
        the same node does nothing; on another node or in another group it is a Conflict."""
        _id(run_id, "a run id")
        _id(group_id, "a group id")
        _id(node_id, "a node id")
        version = _version_text(policy_version)

        def work(cur):
            group = cur.execute("SELECT size FROM stepmill.groups WHERE id = %s FOR UPDATE", [group_id]).fetchone()
            if group is None:
                raise NotFound(f"no group {group_id!r} is registered with the coordinator")
            if not cur.execute("SELECT 1 FROM stepmill.nodes WHERE id = %s", [node_id]).fetchone():
                raise NotFound(f"no node {node_id!r} is registered with the coordinator")
            if not self._registered_as(cur, run_id, group_id, node_id):
                count = cur.execute("SELECT count(*) AS n FROM stepmill.runs WHERE group_id = %s",
                                    [group_id]).fetchone()
                if count["n"] >= group["size"]:
                    raise Conflict(f"group {group_id!r} has its {group['size']} runs already")
                inserted = cur.execute(
                    "INSERT INTO stepmill.runs (id, group_id, node_id, policy_version, oldest_version)"
                    " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
                    [run_id, group_id, node_id, version, version_number(version)]).rowcount
                if not inserted:  # registered by another runner at the same moment
                    self._registered_as(cur, run_id, group_id, node_id)
                cur.execute("UPDATE stepmill.groups SET oldest_version = least(oldest_version, %s::bigint)"
                            " WHERE id = %s", [version_number(version), group_id])
        self._run(work)

    @staticmethod
    def _registered_as(cur, run_id: str, group_id: str, node_id: str) -> bool:
        """True when the run is registered exactly so; a Conflict when it is registered otherwise."""
        row = cur.execute("SELECT group_id, node_id FROM stepmill.runs WHERE id = %s", [run_id]).fetchone()
        if row is None:
            return False
        if (row["group_id"], row["node_id"]) != (group_id, node_id):
            raise Conflict(f"run {run_id!r} is registered on node {row['node_id']!r} in group {row['group_id']!r}")
        return True

    def report(self, run_id: str, *, finished: bool = False, committed: bool = False, scored: bool = False,
               policy_version: str | int | None = None) -> bool:
        """What the runner or node knows of a run now (each flag, once true, stays true; a policy version
        its steps carry lowers the group's oldest). Returns whether the run's group is ready."""
        _id(run_id, "a run id")
        version = _version_text(policy_version)

        def work(cur):
            run = cur.execute("SELECT group_id FROM stepmill.runs WHERE id = %s", [run_id]).fetchone()
            if run is None:
                raise NotFound(f"no run {run_id!r} is registered with the coordinator")
            group_id = run["group_id"]
            # The group row first, as registering does: a group's runs are counted under its lock.
            cur.execute("SELECT 1 FROM stepmill.groups WHERE id = %s FOR UPDATE", [group_id])
            number = version_number(version)
            cur.execute("UPDATE stepmill.runs SET finished = finished OR %s, committed = committed OR %s,"
                        " scored = scored OR %s, policy_version = coalesce(%s, policy_version),"
                        " oldest_version = least(oldest_version, %s::bigint) WHERE id = %s",
                        [bool(finished), bool(committed), bool(scored), version, number, run_id])
            row = cur.execute(
                "UPDATE stepmill.groups g SET oldest_version = least(oldest_version, %s::bigint),"
                " ready_at = CASE WHEN ready_at IS NULL AND size = (SELECT count(*) FROM stepmill.runs r"
                "   WHERE r.group_id = g.id AND r.finished AND r.committed AND r.scored) THEN now() ELSE ready_at END"
                " WHERE id = %s RETURNING ready_at IS NOT NULL AS ready", [number, group_id]).fetchone()
            return row["ready"]
        return self._run(work)

    def group(self, group_id: str) -> dict:
        """A group as the coordinator sees it, with its runs (node and flags of each)."""
        _id(group_id, "a group id")

        def work(cur):
            row = cur.execute(
                "SELECT id, channel, size, state, ready_at IS NOT NULL AS ready, consumer, lease_id,"
                " extract(epoch FROM lease_until)::float8 AS lease_until, oldest_version"
                " FROM stepmill.groups WHERE id = %s", [group_id]).fetchone()
            if row is None:
                raise NotFound(f"no group {group_id!r} is registered with the coordinator")
            runs = cur.execute("SELECT id, node_id, finished, committed, scored, policy_version FROM stepmill.runs"
                               " WHERE group_id = %s ORDER BY id", [group_id]).fetchall()
            version = row.pop("oldest_version")
            row["policy_version"] = None if version is None else str(version)
            row["runs"] = {run.pop("id"): run for run in runs}
            return row
        return self._run(work)

    def counts(self, channel: str | None = None) -> dict:
        """Every group in one of: waiting (not ready), ready (to be handed out now), leased, acked, stale,
        and lost (not acknowledged, with runs on a node that stopped heartbeating: see ``lost_groups``)."""

        def work(cur):
            row = cur.execute(
                "WITH g AS (SELECT state, ready_at IS NOT NULL AS ready, coalesce(lease_until < now(), false)"
                "   AS ran_out, state IN ('open', 'leased') AND EXISTS (SELECT 1 FROM stepmill.runs r"
                "     JOIN stepmill.nodes n ON n.id = r.node_id WHERE r.group_id = groups.id"
                "     AND n.heartbeat_at < now() - %(timeout)s * interval '1 second') AS lost"
                "   FROM stepmill.groups WHERE %(channel)s::text IS NULL OR channel = %(channel)s::text)"
                " SELECT count(*) FILTER (WHERE NOT lost AND state = 'open' AND NOT ready) AS waiting,"
                " count(*) FILTER (WHERE NOT lost AND ready AND (state = 'open' OR (state = 'leased' AND ran_out)))"
                "   AS ready,"
                " count(*) FILTER (WHERE NOT lost AND state = 'leased' AND NOT ran_out) AS leased,"
                " count(*) FILTER (WHERE state = 'acked') AS acked, count(*) FILTER (WHERE state = 'stale') AS stale,"
                " count(*) FILTER (WHERE lost) AS lost FROM g",
                {"channel": channel, "timeout": self.node_timeout_s}).fetchone()
            return dict(row)
        return self._run(work)

    # --- policy version and staleness ---------------------------------------------------------------------

    def _setting(self, key: str) -> str | None:
        row = self._run(lambda cur: cur.execute("SELECT value FROM stepmill.settings WHERE key = %s", [key]).fetchone())
        return None if row is None else row["value"]

    def _set(self, key: str, value: str | None) -> None:
        self._run(lambda cur: cur.execute(
            "INSERT INTO stepmill.settings (key, value) VALUES (%s, %s)"
            " ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value", [key, value]))

    def policy_version(self) -> str | None:
        """The fleet's current policy version (None until one is set)."""
        return self._setting("policy_version")

    def set_policy_version(self, version: str | int | None) -> None:
        self._set("policy_version", _version_text(version))

    def max_staleness(self) -> int | None:
        """How many policy versions a group's oldest may lag the current before it is stale (None: no limit)."""
        value = self._setting("max_staleness")
        return None if value is None else int(value)

    def set_max_staleness(self, versions: int | None) -> None:
        if versions is not None and (isinstance(versions, bool) or not isinstance(versions, int) or versions < 0):
            raise BadInput(f"max_staleness must be a non-negative integer or None, got {versions!r:.40}")
        self._set("max_staleness", None if versions is None else str(versions))

    def set_node_timeout(self, seconds: float | None) -> None:
        """The fleet's node timeout, for every process that opens the coordinator without its own from now
        (None: back to 120 s); this process's too."""
        if seconds is not None:
            seconds = _seconds(seconds, "node_timeout_s")
        self._set("node_timeout_s", None if seconds is None else repr(float(seconds)))
        self.node_timeout_s = DEFAULT_NODE_TIMEOUT if seconds is None else seconds

    # --- claims -----------------------------------------------------------------------------------------

    def claim(self, consumer: str, n: int = 1, lease_seconds: float = 600.0, channel: str | None = "train",
              max_staleness: int | None = None) -> list[GroupLease]:
        """Up to ``n`` ready groups of the channel (None: any channel), oldest ready first, each leased to
        this consumer for ``lease_seconds`` seconds. Stale groups met on the way are set aside (stale: more
        versions behind than the fleet's ``max_staleness``, or this claim's when that is lower)."""
        _id(consumer, "a consumer name")
        if channel is not None:
            _id(channel, "a channel")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadInput(f"n must be a positive integer, got {n!r:.40}")
        lease_seconds = _seconds(lease_seconds, "lease_seconds")
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise BadInput(f"max_staleness must be a non-negative integer or None, got {max_staleness!r:.40}")

        def work(cur):
            settings = {row["key"]: row["value"] for row in cur.execute(
                "SELECT key, value FROM stepmill.settings WHERE key IN ('policy_version', 'max_staleness')")}
            current = version_number(settings.get("policy_version"))
            limits = [int(v) for v in (settings.get("max_staleness"), max_staleness) if v is not None]
            allowed = min(limits) if limits else None
            oldest_allowed = None if current is None or allowed is None else current - int(allowed)
            leased: list[str] = []
            while len(leased) < n:
                rows = cur.execute(CLAIMABLE, {"channel": channel, "timeout": self.node_timeout_s,
                                               "limit": n - len(leased)}).fetchall()
                if not rows:
                    break
                expired = [row["lease_id"] for row in rows if row["lease_id"] is not None]
                if expired:
                    cur.execute("UPDATE stepmill.leases SET ended = 'expired', ended_at = now()"
                                " WHERE id = ANY(%s) AND ended IS NULL", [expired])
                for row in rows:
                    if oldest_allowed is not None and row["oldest_version"] is not None \
                            and row["oldest_version"] < oldest_allowed:
                        cur.execute("UPDATE stepmill.groups SET state = 'stale', lease_id = NULL, consumer = NULL,"
                                    " lease_until = NULL WHERE id = %s", [row["id"]])
                        continue
                    staleness = None if current is None or row["oldest_version"] is None \
                        else current - row["oldest_version"]
                    lease = cur.execute(
                        "INSERT INTO stepmill.leases (group_id, consumer, lease_until, policy_version, staleness)"
                        " VALUES (%s, %s, now() + %s * interval '1 second', %s, %s) RETURNING id, lease_until",
                        [row["id"], consumer, lease_seconds, settings.get("policy_version"), staleness]).fetchone()
                    cur.execute("UPDATE stepmill.groups SET state = 'leased', lease_id = %s, consumer = %s,"
                                " lease_until = %s WHERE id = %s",
                                [lease["id"], consumer, lease["lease_until"], row["id"]])
                    leased.append(row["id"])
            return self._claims(cur, "g.id = ANY(%s)", [leased])
        return self._run(work)

    def held(self, consumer: str) -> list[GroupLease]:
        """The groups leased to this consumer and not acknowledged (a consumer restarting under its name
        takes them up again; one whose lease ran out is still its own until another consumer claims it)."""
        _id(consumer, "a consumer name")
        return self._run(lambda cur: self._claims(cur, "g.state = 'leased' AND g.consumer = %s", [consumer]))

    @staticmethod
    def _claims(cur, where: str, params: list) -> list[GroupLease]:
        groups = cur.execute(f"SELECT {CLAIM_FIELDS} FROM stepmill.groups g WHERE {where} ORDER BY g.ready_at, g.id",
                             params).fetchall()
        if not groups:
            return []
        runs = cur.execute("SELECT r.id, r.group_id, r.node_id, n.serve_url FROM stepmill.runs r"
                           " JOIN stepmill.nodes n ON n.id = r.node_id WHERE r.group_id = ANY(%s) ORDER BY r.id",
                           [[g["group_id"] for g in groups]]).fetchall()
        claims = []
        for g in groups:
            mine = [r for r in runs if r["group_id"] == g["group_id"]]
            version = g.pop("oldest_version")
            claims.append(GroupLease(**g, policy_version=None if version is None else str(version),
                                runs={r["id"]: r["node_id"] for r in mine},
                                nodes={r["node_id"]: r["serve_url"] for r in mine}))
        return claims

    def _held_group(self, cur, claim: GroupLease) -> dict:
        if not isinstance(claim, GroupLease):
            raise BadInput(f"expected a GroupLease, got {type(claim).__name__}")
        row = cur.execute("SELECT state, lease_id, consumer FROM stepmill.groups WHERE id = %s FOR UPDATE",
                          [claim.group_id]).fetchone()
        if row is None:
            raise NotFound(f"no group {claim.group_id!r} is registered with the coordinator")
        return row

    @staticmethod
    def _not_held(claim: GroupLease, row: dict) -> Conflict:
        if row["state"] == "leased":
            now = f"leased to {row['consumer']!r} now"
        elif row["state"] == "acked":
            now = f"acknowledged by {row['consumer']!r}"
        else:
            now = f"{row['state']} now"
        return Conflict(f"group {claim.group_id!r} is no longer leased to {claim.consumer!r} (its lease ran out): "
                        f"it is {now}")

    def ack(self, claim: GroupLease) -> None:
        """The group is consumed: it is never handed out again. Acknowledging again under the same claim does
        nothing; a claim whose lease ran out and whose group went to another consumer is refused (Conflict)."""
        self.ack_many([claim])

    def ack_many(self, claims: list[GroupLease]) -> None:
        """The groups are consumed, all in one transaction or none: a claim no longer held (its lease ran out
        and another consumer took the group, or it was given back) makes it a Conflict naming each such
        group (its ``groups``), and nothing is acknowledged. Claims acknowledged already do nothing more."""
        claims = list(claims)
        for claim in claims:
            if not isinstance(claim, GroupLease):
                raise BadInput(f"expected a GroupLease, got {type(claim).__name__}")
        if not claims:
            return

        def work(cur):
            ids = sorted({claim.group_id for claim in claims})
            rows = {row["id"]: row for row in cur.execute(  # locked in one order: concurrent acks never deadlock
                "SELECT id, state, lease_id, consumer FROM stepmill.groups WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                [ids])}
            unknown = [group for group in ids if group not in rows]
            if unknown:
                raise NotFound(f"no group {', '.join(map(repr, unknown))} is registered with the coordinator")
            lost = [claim for claim in claims if rows[claim.group_id]["lease_id"] != claim.lease_id
                    or rows[claim.group_id]["state"] not in ("leased", "acked")]
            if lost:
                error = self._not_held(lost[0], rows[lost[0].group_id]) if len(claims) == 1 else Conflict(
                    "; ".join(str(self._not_held(c, rows[c.group_id])) for c in lost)
                    + f". None of the {len(claims)} groups was acknowledged")
                error.groups = [claim.group_id for claim in lost]
                raise error
            acking = [c for c in claims if rows[c.group_id]["state"] == "leased"]
            if acking:
                cur.execute("UPDATE stepmill.groups SET state = 'acked', acked_at = now(), lease_until = NULL"
                            " WHERE id = ANY(%s)", [[c.group_id for c in acking]])
                cur.execute("UPDATE stepmill.leases SET ended = 'acked', ended_at = now() WHERE id = ANY(%s)",
                            [[c.lease_id for c in acking]])
        self._run(work)

    def release_many(self, claims: list[GroupLease]) -> list[str]:
        """Give back those of the groups still held under these claims, in one transaction, to be handed out
        again at once; returns them (the others are left as they are)."""
        claims = list(claims)
        for claim in claims:
            if not isinstance(claim, GroupLease):
                raise BadInput(f"expected a GroupLease, got {type(claim).__name__}")
        if not claims:
            return []

        def work(cur):
            rows = {row["id"]: row for row in cur.execute(
                "SELECT id, state, lease_id FROM stepmill.groups WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                [sorted({c.group_id for c in claims})])}
            held = [c for c in claims if c.group_id in rows and rows[c.group_id]["state"] == "leased"
                    and rows[c.group_id]["lease_id"] == c.lease_id]
            if held:
                cur.execute("UPDATE stepmill.groups SET state = 'open', lease_id = NULL, consumer = NULL,"
                            " lease_until = NULL WHERE id = ANY(%s)", [[c.group_id for c in held]])
                cur.execute("UPDATE stepmill.leases SET ended = 'released', ended_at = now() WHERE id = ANY(%s)",
                            [[c.lease_id for c in held]])
            return [c.group_id for c in held]
        return self._run(work)

    def release(self, claim: GroupLease) -> None:
        """Give the group back unconsumed, to be handed out again at once. Releasing twice does nothing."""

        def work(cur):
            row = self._held_group(cur, claim)
            if row["state"] == "leased" and row["lease_id"] == claim.lease_id:
                cur.execute("UPDATE stepmill.groups SET state = 'open', lease_id = NULL, consumer = NULL,"
                            " lease_until = NULL WHERE id = %s", [claim.group_id])
                cur.execute("UPDATE stepmill.leases SET ended = 'released', ended_at = now() WHERE id = %s",
                            [claim.lease_id])
                return
            ended = cur.execute("SELECT ended FROM stepmill.leases WHERE id = %s AND group_id = %s",
                                [claim.lease_id, claim.group_id]).fetchone()
            if ended is None or ended["ended"] != "released":
                raise self._not_held(claim, row)
        self._run(work)

    def renew(self, claim: GroupLease, lease_seconds: float) -> GroupLease:
        """The same claim with its lease extended to ``lease_seconds`` seconds from now (a consumer still working)."""
        lease_seconds = _seconds(lease_seconds, "lease_seconds")

        def work(cur):
            row = self._held_group(cur, claim)
            if row["state"] != "leased" or row["lease_id"] != claim.lease_id:
                raise self._not_held(claim, row)
            until = cur.execute("UPDATE stepmill.groups SET lease_until = now() + %s * interval '1 second'"
                                " WHERE id = %s RETURNING lease_until", [lease_seconds, claim.group_id]).fetchone()
            cur.execute("UPDATE stepmill.leases SET lease_until = %s WHERE id = %s",
                        [until["lease_until"], claim.lease_id])
            return self._claims(cur, "g.id = %s", [claim.group_id])[0]
        return self._run(work)

    def history(self, group_id: str) -> list[dict]:
        """Every lease the group was given, oldest first: lease_id, consumer, claimed_at, lease_until, ended
        (acked | released | expired | None while held), ended_at; times in epoch seconds; policy_version (the
        fleet's at the claim) and staleness (how many versions the group was behind; None: not integers)."""
        _id(group_id, "a group id")
        return self._run(lambda cur: cur.execute(
            "SELECT id AS lease_id, consumer, extract(epoch FROM claimed_at)::float8 AS claimed_at,"
            " extract(epoch FROM lease_until)::float8 AS lease_until, ended, extract(epoch FROM ended_at)::float8"
            " AS ended_at, policy_version, staleness FROM stepmill.leases WHERE group_id = %s ORDER BY id",
            [group_id]).fetchall())

    # --- nodes that went away ------------------------------------------------------------------------------

    def lost_groups(self) -> list[LostGroup]:
        """Groups not acknowledged with runs on a node silent for longer than ``node_timeout_s``: one
        entry per group and silent node. They are not handed out until the node heartbeats again."""
        rows = self._run(lambda cur: cur.execute(
            "SELECT DISTINCT g.id AS group_id, g.state, n.id AS node_id, n.serve_url,"
            " extract(epoch FROM n.heartbeat_at)::float8 AS last_heartbeat,"
            " extract(epoch FROM now() - n.heartbeat_at)::float8 AS silent_s"
            " FROM stepmill.groups g JOIN stepmill.runs r ON r.group_id = g.id"
            " JOIN stepmill.nodes n ON n.id = r.node_id"
            " WHERE g.state IN ('open', 'leased') AND n.heartbeat_at < now() - %s * interval '1 second'"
            " ORDER BY g.id, n.id", [self.node_timeout_s]).fetchall())
        return [LostGroup(row["group_id"], row["state"], row["node_id"], row["serve_url"], row["last_heartbeat"],
                          f"node {row['node_id']!r} ({row['serve_url']}) has sent no heartbeat for "
                          f"{row['silent_s']:.0f} s (timeout {self.node_timeout_s:g} s); the group's steps are there, "
                          "so it is not handed out until the node comes back")
                for row in rows]


def migrate(conn) -> int:
    """Apply pending migrations in one transaction (DDL is transactional in PostgreSQL). Returns the schema
    version. An up-to-date database is only read; a newer one than this stepmill knows is refused."""
    def applied() -> set[int]:
        if conn.execute("SELECT to_regclass('stepmill.schema_migrations') AS t").fetchone()[0] is None:
            return set()
        return {row[0] for row in conn.execute("SELECT version FROM stepmill.schema_migrations")}

    def check(done: set[int]) -> None:
        if done and max(done) > len(MIGRATIONS):
            raise StoreUnavailable(f"the coordinator's schema is version {max(done)}, this stepmill knows "
                                   f"{len(MIGRATIONS)}: upgrade stepmill")

    with conn.transaction():
        done = applied()
    check(done)
    if len(done) == len(MIGRATIONS):
        return len(MIGRATIONS)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [MIGRATION_LOCK])
        conn.execute("CREATE SCHEMA IF NOT EXISTS stepmill")
        conn.execute("CREATE TABLE IF NOT EXISTS stepmill.schema_migrations (version integer PRIMARY KEY,"
                     " name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")
        done = applied()
        check(done)
        for version, (name, statements) in enumerate(MIGRATIONS, start=1):
            if version in done:
                continue
            for statement in statements:
                conn.execute(statement)
            conn.execute("INSERT INTO stepmill.schema_migrations (version, name) VALUES (%s, %s)", [version, name])
    return len(MIGRATIONS)
