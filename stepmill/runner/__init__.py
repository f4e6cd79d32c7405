"""The rollout runner: configuration, isolation of agent runs, and running them through the proxy."""
