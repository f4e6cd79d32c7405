"""``stepmill experiment experiments.toml``: a matrix of training runs, each beside its paired control,
on the real vLLM, and a report of them (docs/experiments.md).

    spec.py     the experiments file: a default cell and the factors varied around it, the seeds
    catalog.py  what a cell's dataset (bundled prompts and their reward) and runtime (its [[agent]]) are
    cell.py     one cell and seed: its rollout file, ``stepmill train`` in a child, its results as JSON
    stats.py    a cell's numbers over its seeds (means, 95% t-intervals)
    report.py   the Markdown table and the reward curves (PNG) from the results folder
    command.py  the click command
"""
