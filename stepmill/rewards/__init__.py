"""Rewards: reward functions and the scoring that runs them over finished trajectories."""
