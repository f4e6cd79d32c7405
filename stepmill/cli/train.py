"""``stepmill train``: the closed loop over a rollout file's ``[train]`` table (the ``torch`` extra)."""

from __future__ import annotations

import importlib.util

import click

from stepmill.cli.options import config_db_option, on_interrupt, stop_on_signals
from stepmill.errors import ConfigError
from stepmill.train.config import AGGREGATIONS, ATTENTIONS, DTYPES, LAYOUTS, METHODS, MODES


@on_interrupt("interrupted: the groups a step had claimed go back when their lease runs out; what ran is kept")
@click.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(exists=True, dir_okay=False))
@config_db_option
@click.option("--model", "model", type=click.Path(exists=True, file_okay=False),
              help="The weights the engine serves at the start (an HF folder).")
@click.option("--method", type=click.Choice(METHODS), default=None)
@click.option("--layout", type=click.Choice(LAYOUTS), default=None)
@click.option("--aggregation", type=click.Choice(AGGREGATIONS), default=None)
@click.option("--mode", type=click.Choice(MODES), default=None)
@click.option("--iterations", type=click.IntRange(0), default=None)
@click.option("--epochs", type=click.IntRange(1), default=None, help="Optimizer steps on each version's groups.")
@click.option("--lr", type=float, default=None)
@click.option("--kl", type=float, default=None)
@click.option("--max-staleness", type=click.IntRange(0), default=None)
@click.option("--engine", default=None, help="The engine's admin origin (default: [route] base_url's).")
@click.option("--seed", type=int, default=None)
@click.option("--device", default=None, help="auto (CUDA when present), cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="auto: bfloat16 on a GPU, float32 on the CPU.")
@click.option("--attention", type=click.Choice(ATTENTIONS), default=None)
@click.option("--micro-batch-tokens", type=click.IntRange(0), default=None,
              help="Real tokens per forward/backward, gradients accumulated (0: the whole batch).")
@click.option("--control/--no-control", default=None, help="Run the paired control (same seeds, no optimizer step).")
@click.option("--name", default="train", show_default=True, help="The run's name in train_metrics.")
@click.option("--resume", is_flag=True,
              help="Continue the run (and its control) from its last checkpoint (<db>.checkpoints/<name>/).")
@click.option("--no-progress", is_flag=True)
def train(config_path, db, no_progress, name, resume, **overrides):
    """Roll out, consume whole groups, take an optimizer step, serve the new weights (verified), repeat;
    then print reward per policy version for the run and its control."""
    if importlib.util.find_spec("torch") is None:
        raise ConfigError("stepmill train needs torch: pip install 'stepmill[torch]'")
    from stepmill.runner.config import load
    from stepmill.train.config import load_train
    from stepmill.train.loop import train_loop
    from stepmill.train.summary import summary_table

    config = load(config_path)
    settings = load_train(config, **overrides)  # the file parsed once, by load()
    stop_on_signals()
    outcome = train_loop(config, settings, db=db, progress=not no_progress, name=name, resume=resume)
    click.echo(summary_table(outcome))


COMMANDS = [train]
