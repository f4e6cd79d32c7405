"""The fleet as the lifecycle page shows it, from the coordinator ``STEPMILL_COORDINATOR`` names: nodes
with their last heartbeat, groups by state, and the lost groups with their node. The coordinator's
address is shown with its password hidden; one connection per page view (blocking: a worker thread)."""

from __future__ import annotations

import os
from dataclasses import asdict

from stepmill.errors import BadInput, ConfigError, StoreUnavailable
from stepmill.store.fleet_ledger import ENV, Coordinator, redacted


def fleet() -> dict | None:
    """None without a coordinator; else {coordinator, node_timeout_s, nodes, counts, lost} or {coordinator, error}."""
    url = os.environ.get(ENV)
    if not url:
        return None
    try:
        with Coordinator(url, retry_s=2) as coordinator:
            return {"coordinator": coordinator.url, "node_timeout_s": coordinator.node_timeout_s,
                    "nodes": coordinator.nodes(), "counts": coordinator.counts(None),
                    "lost": [asdict(group) for group in coordinator.lost_groups()]}
    except (StoreUnavailable, ConfigError, BadInput) as exc:  # messages never carry the password
        return {"coordinator": redacted(url), "error": str(exc)}
