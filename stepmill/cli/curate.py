"""Commands that judge the steps: rewards, reviews, scoring, reviewers and the review UI."""

from __future__ import annotations

import os
import tempfile

import click

from stepmill.cli.options import CurationChoice, address_options, db_option, dbs_option, where_clause, where_options
from stepmill.cli.stores import open_reader, open_writer
from stepmill.errors import NotFound


@click.command()
@db_option
@click.argument("target")
@click.argument("value", type=float)
@click.option("--source", type=CurationChoice("SOURCES"), default="human", show_default=True)
@click.option("--name", help="Who or what gave it (a person, a function).")
@click.option("--note")
def reward(db, target, value, source, name, note):
    """Append a reward to a step, a trajectory, or the step of an upstream response id.

    Rewards are never overwritten: the latest human one counts, else the latest of any source.
    """
    import math

    if not math.isfinite(value):
        raise click.BadParameter("the reward must be a finite number")
    store = open_writer(db)
    try:
        row = store.add_reward(target, value, source=source, name=name or os.environ.get("USER"), note=note)
    except NotFound:
        raise NotFound(f"no step, trajectory or upstream response {target!r} in {db}") from None
    click.echo(f"{row['target_kind']} {row['target_id']}: reward {row['value']} ({row['source']})")


@click.command()
@db_option
@click.argument("target")
@click.option("--label", type=CurationChoice("LABELS"))
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
    except NotFound:
        raise NotFound(f"no step or trajectory {target!r} in {db}") from None
    state = store.curation(target)["review"]
    click.echo(f"{target}: label {state['label'] or '-'}, {'trainable' if state['trainable'] else 'untrainable'}"
               + (f", tags {', '.join(state['tags'])}" if state["tags"] else ""))


@click.command()
@db_option
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="A TOML file of [[reward]] tables (see `stepmill.rewards.scoring`).")
@where_options("SQL condition on trajectories (alias t), e.g. \"t.group_id = :g\".")
@click.option("--batch-size", default=32, show_default=True)
def score(db, config_path, where, params, batch_size):
    """Score completed trajectories with the reward functions of a configuration."""
    from stepmill.rewards.scoring import load_config
    from stepmill.rewards.scoring import score as run_score

    specs = load_config(config_path)
    condition, values = where_clause(where, params)
    reports = run_score(open_writer(db), specs, where=condition, params=values, batch_size=batch_size)
    for name, report in reports.items():
        click.echo(f"{name}: scored {report.scored}, failed {report.failed}, skipped {report.skipped}"
                   " (not matching its where)", err=True)
    if any(report.failed for report in reports.values()):
        click.echo("failures are recorded as reward rows without a value (their error in details); "
                   "they are tried again on the next run", err=True)


@click.command()
@db_option
@click.argument("name")
@click.option("--url", default="http://127.0.0.1:8001", show_default=True, help="Where `stepmill ui` serves.")
def reviewer(db, name, url):
    """Create (or replace) a named reviewer's sign-in link for `stepmill ui`."""
    token = open_writer(db).create_reviewer(name)
    click.echo(f"{url.rstrip('/')}/-/stepmill/sign-in?token={token}")
    click.echo(f"(give it to {name} only; running this again replaces it)", err=True)


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@dbs_option
@address_options(8001)
@click.argument("datasette_args", nargs=-1, type=click.UNPROCESSED)
def ui(dbs, port, host, datasette_args):
    """Browse, review and curate the steps in Datasette.

    It prints a one-time sign-in link for you; nobody reads or writes without signing in, on
    localhost too (agents must not read answers or change rewards). Others sign in with a reviewer
    link (`stepmill reviewer NAME`). With several --db files (one per node), each page reads the
    file that holds its id; with STEPMILL_COORDINATOR set, the lifecycle page shows the fleet.
    """
    from datasette.cli import cli as datasette_cli

    from stepmill.ui.settings import serve_args

    for db in dbs:  # a missing file is refused: a mistyped --db must not leave an empty database behind
        if os.access(db, os.W_OK):
            open_writer(db).close()  # migrate the file first, so Datasette sees the full schema
        else:
            open_reader(db).close()  # a read-only copy: read as it is (reviews there are refused)

    click.echo("stepmill ui: nothing is shown without signing in; yours is the one-time link below "
               "(keep it to yourself), reviewers' come from `stepmill reviewer NAME`", err=True)

    with tempfile.TemporaryDirectory(prefix="stepmill-ui-") as folder:
        args = serve_args(list(dbs), folder, host=host, port=port) + list(datasette_args)
        datasette_cli.main(args=args, prog_name="stepmill ui", standalone_mode=False)


COMMANDS = [reward, review, score, reviewer, ui]
