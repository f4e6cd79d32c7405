"""The offline demo: the whole lifecycle on the simulated LLM (or a real vLLM) in one command."""
