"""stepmill: agents' LLM traffic in, training-ready RL step records out."""

__version__ = "0.1.0"
