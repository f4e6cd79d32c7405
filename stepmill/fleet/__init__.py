"""The fleet: several nodes (each a proxy writing its own SQLite file) and trainers on other machines.

- ``node_server``: `stepmill serve`, one node's consumption stream over HTTP (``batch_wire``: its batches
  as bytes); ``node_consumer``: that stream from a trainer's side;
- ``node_agent``: a node's heartbeats and the readiness of its runs, told to the coordinator;
- ``remote_consumer``: groups claimed through the coordinator, fetched from the nodes that hold them;
- ``ray_rollout`` and ``ray_node``: a rollout's runs on the nodes of a Ray cluster;
- ``ray_dataset``: every node's curated steps as one Ray Dataset, read where each file lies.

The coordinator's ledger (PostgreSQL: registry, readiness, leases, the policy version) is the store's
(``stepmill.store.fleet_ledger``); the fleet uses it, never the other way round.
"""
