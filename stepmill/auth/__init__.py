"""Who may do what: the control token, and the per-run secrets that admit a run's calls."""
