"""Where a training run takes its groups from (``[train] consumer``): this machine's store, one node's
`stepmill serve`, or the fleet's coordinator; each claims whole, scored groups of the run's channel."""

from __future__ import annotations

from stepmill.errors import ConfigError
from stepmill.store import Store
from stepmill.train.config import TrainConfig


def group_consumer(train: TrainConfig, store: Store, name: str, *, n: int, channel: str):
    """The consumer ``[train] consumer`` names (``local``: ``store``), under ``name``; in async mode it
    sets aside groups older than ``max_staleness`` versions."""
    kind = train.consumer
    staleness = train.max_staleness if train.mode == "async" else None
    if kind == "local":
        from stepmill.trainer_bridge.consume import Consumer

        return Consumer(store, name, n=n, channel=channel, max_staleness=staleness, scored=True)
    if kind.startswith(("http://", "https://")):
        from stepmill.fleet.node_consumer import NodeConsumer

        return NodeConsumer(kind, name, n=n, channel=channel, max_staleness=staleness, scored=True)
    if kind.startswith(("postgres://", "postgresql://")):
        from stepmill.fleet.remote_consumer import RemoteConsumer

        # the coordinator hands out a node's groups once they are complete and scored
        return RemoteConsumer(kind, name, channel=channel, max_staleness=staleness)
    raise ConfigError(f"[train] consumer: local, an http(s):// serve URL or a postgresql:// coordinator, not {kind!r}")
