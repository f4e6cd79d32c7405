"""Commands that read the captured steps out: stats, export, tokenize, batches, and the consumption server."""

from __future__ import annotations

import json

import click

from stepmill.cli.options import (
    address_options,
    confdir_option,
    coordinator_option,
    db_option,
    json_option,
    where_clause,
    where_options,
)
from stepmill.cli.stores import open_reader, open_writer


@click.command()
@db_option
@json_option
@click.option("--proxy", "proxy_url", metavar="URL",
              help="A running stepmill proxy (http://host:port): its capture too, from its /v1/health: whether each "
                   "worker's handoff thread, writer and state watch live, and the calls it dropped.")
@confdir_option
def stats(db, as_json, proxy_url, confdir):
    """Counts per api, model and status; trajectories; tokens; token fidelity; calls kept unread."""
    from stepmill.pipeline import journal

    store = open_reader(db)
    data = journal.stats_with_backlog(store)
    if proxy_url:
        data["capture"] = _proxy_capture(proxy_url, confdir)
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
    from stepmill.trainer_bridge.consume import staleness_summary

    consumed = staleness_summary(store.consumption_staleness())
    if consumed:
        click.echo(consumed)
    backlog = data["journal"]
    if backlog["uncommitted_bytes"]:
        click.echo(f"not yet committed: {backlog['uncommitted_bytes']} bytes of calls in {backlog['journals']} "
                   "journal(s); a running proxy commits them when the file takes writes, or the next start does")
    if data["unreadable_calls"]:
        click.echo(f"unreadable calls: {data['unreadable_calls']}, kept as error steps (the proxy's log says why)")
    if proxy_url:
        click.echo(_capture_line(data["capture"]))


def _proxy_capture(url: str, confdir: str) -> dict:
    """The capture section of a running proxy's health; ``{"error": ...}`` when it does not answer it."""
    from stepmill.client import ControlError, StepmillClient

    try:
        return StepmillClient(proxy=url, confdir=confdir, timeout=10).health().get("capture") or {}
    except (ControlError, OSError, ValueError) as exc:
        return {"error": f"the proxy at {url} did not answer its health: {exc}"}


def _capture_line(capture: dict) -> str:
    """One line per worker: which of its threads live, and the calls it could not keep."""
    if "error" in capture:
        return f"capture: {capture['error']}"
    lines = []
    for worker in capture.get("workers") or [capture]:
        if "threads" not in worker:
            lines.append(f"capture, worker {worker.get('worker', 0)}: no answer ({worker.get('error', 'not started')})")
            continue
        threads = ", ".join(f"{name.replace('_', ' ')} {'alive' if thread['alive'] else 'DEAD'}"
                            + (f" ({thread['error']})" if thread.get("error") else "")
                            + (f" (started again {thread['restarts']}×)" if thread.get("restarts") else "")
                            for name, thread in worker["threads"].items())
        lines.append(f"capture, worker {worker.get('worker', 0)}: {threads}; dropped {worker.get('dropped', 0)}, "
                     f"journaled without bodies {worker.get('not_cleaned', 0)}")
    return "\n".join(lines)


@click.command()
@db_option
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default="jsonl", show_default=True)
@click.option("--flavour", type=click.Choice(["tokens", "messages"]), default="tokens", show_default=True,
              help="Parquet: token-level (verl-style) or message-level (TRL).")
@click.option("--out", default="-", help="JSONL: a file (default stdout). Parquet: a folder (shards + manifest.json).")
@where_options()
@click.option("--no-tokens", is_flag=True, help="JSONL: leave prompt_ids / response_ids / logprobs out.")
@click.option("--no-gate", is_flag=True, help="Export every selected step, also those reviews took out.")
def export(db, fmt, flavour, out, where, params, no_tokens, no_gate):
    """Write steps (through the curation gate) as JSON Lines, or as Parquet shards with a manifest."""
    store = open_reader(db)
    condition, values = where_clause(where, params)
    gate = store.gate_counts(condition, values)  # a --where SQLite refuses is BadInput, from here or below
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
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(gate["removed_by_reason"].items()))
    if no_gate:
        click.echo(f"exported {count} steps (gate off; it would remove {gate['removed']}{': ' + why if why else ''})",
                   err=True)
    else:
        click.echo(f"exported {count} steps; the curation gate removed {gate['removed']}{': ' + why if why else ''}",
                   err=True)


@click.command()
@db_option
@click.option("--tokenizer", "tokenizer_path", required=True,
              help="A local tokenizer folder, or a model name already in the Hugging Face cache.")
@where_options("SQL condition on steps (alias s). Default: steps with a completion and no ids yet."
               " Steps with exact (engine-sampled) ids are never selected.")
@click.option("--splice", is_flag=True,
              help="Where the parent has exact ids, keep them and render only the new messages.")
@click.option("--redo", is_flag=True, help="Render again steps that already have rendered or spliced ids.")
@click.option("--batch-size", default=64, show_default=True)
def tokenize(db, tokenizer_path, where, params, splice, redo, batch_size):
    """Render steps without exact ids with the tokenizer's chat template, and check the result."""
    from stepmill.trainer_bridge import tokenize_steps

    store = open_writer(db)
    condition, values = where_clause(where, params)
    report = tokenize_steps(store, tokenizer_path, where=condition, params=values, splice=splice, redo=redo,
                            batch_size=batch_size)
    click.echo(f"rendered {report.rendered} steps ({report.spliced} spliced), {report.divergent} with template "
               f"divergences, {report.skipped} skipped, {report.failed} failed", err=True)


@click.command()
@db_option
@click.option("--layout", type=click.Choice(["step", "trajectory", "tree"]), default="step", show_default=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for the batches.")
@where_options()
@click.option("--group", "group_ids", multiple=True, help="With --layout tree: the group(s) to pack.")
@click.option("--batch-size", default=64, show_default=True)
@click.option("--max-prompt-length", default=4096, show_default=True)
@click.option("--max-response-length", default=2048, show_default=True)
@click.option("--overlong", type=click.Choice(["drop", "truncate"]), default="drop", show_default=True)
def batches(db, layout, out_dir, where, params, group_ids, batch_size, max_prompt_length, max_response_length,
            overlong):
    """Write curated steps as numpy batches (.npz, with a .json of row metadata and counts)."""
    import numpy as np

    from stepmill.private_files import private_dir, private_opener
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


@click.command()
@db_option
@address_options(8090)
@confdir_option
@click.option("--node-id", help="Serve as this node of a fleet: register with the coordinator, heartbeat, and "
                                "publish the file's finished runs (group readiness) to it.")
@coordinator_option
@click.option("--advertise", help="With --node-id: the URL trainers reach this server at "
                                  "(default http://HOST:PORT).")
@click.option("--heartbeat", "heartbeat_s", default=2.0, show_default=True, type=click.FloatRange(min=0.1),
              help="With --node-id: seconds between heartbeats (each also publishes newly finished runs).")
def serve(db, port, host, confdir, node_id, coordinator, advertise, heartbeat_s):
    """Serve the consumption stream over HTTP (claim / acknowledge, a group's batch, batches as safetensors)."""
    from stepmill.auth.write_token import ensure_token
    from stepmill.fleet.node_server import make_server

    open_writer(db).close()
    server = make_server(db, host, port, ensure_token(confdir))
    agent = None
    if node_id:
        from stepmill.store.fleet_ledger import Coordinator
        from stepmill.fleet.node_agent import NodeAgent

        fleet = Coordinator(coordinator)
        url = advertise or f"http://{host}:{server.server_address[1]}"
        agent = NodeAgent(db, fleet, node_id, url, interval_s=heartbeat_s)
        agent.start()
        click.echo(f"stepmill serve: node {node_id} at {url}, coordinator {fleet.url}", err=True)
    click.echo(f"stepmill serve: http://{host}:{port}/v1/claim (write token needed), steps in {db}", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if agent is not None:
            agent.stop()


COMMANDS = [stats, export, tokenize, batches, serve]
