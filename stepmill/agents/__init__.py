"""Agents shipped with stepmill, runnable by `stepmill rollout`."""
