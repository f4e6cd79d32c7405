"""Training on stepmill's groups (the ``torch`` extra): RL methods, the loss on the three layouts,
the engine's weights synced in place and verified, and the closed loop (``stepmill train``).

Nothing here is imported by the proxy, the writer or the store: torch loads only in a trainer.
"""
