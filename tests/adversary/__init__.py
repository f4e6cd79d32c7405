"""Adversarial agents for tests/test_adversarial.py: real processes the rollout runner starts, each
trying a way around isolation to its own reward, each printing a JSON report of what it got."""
