"""Reward functions a user would write: one that works, one that fails on some trajectories."""


def answer_length(trajectory, limit=200):
    text = (trajectory["completion"] or {}).get("content") or ""
    return {"score": 1.0 if len(text) <= limit else 0.0, "details": {"length": len(text)}}


def broken(trajectory):
    raise RuntimeError(f"cannot score {trajectory['id']}")
