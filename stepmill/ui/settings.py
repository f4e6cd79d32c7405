"""How ``stepmill ui`` starts Datasette on a stepmill database: titles, column labels, facets and
stored queries (``metadata.json``, ``datasette.json``) and the ``datasette serve`` arguments."""

from __future__ import annotations

import json
from pathlib import Path

from stepmill.protocols import protocols
from stepmill.store import views

STEP_COLUMNS = {
    "id": "Step id; open /-/stepmill/steps/<id> for the readable conversation",
    "trajectory_id": "One agent run",
    "group_id": "Runs of the same prompt (GRPO group)",
    "parent_step_id": "The step whose conversation this one continues",
    "step_index": "Position in the trajectory",
    "engine_api": "The protocol of the kept exchange when the proxy served the call through another "
                  "(an engine's chat completions, for exact ids); empty when it is the agent's own",
    "transport": "http, sse or websocket",
    "messages_base_len": "Messages shared with the parent's conversation + completion",
    "messages_suffix": "Messages after the shared prefix (canonical form)",
    "completion": "The assistant message (canonical form)",
    "status": "ok, error or incomplete",
    "ttft_ms": "Time to first token",
    "token_provenance": "none, exact (from the engine), rendered (chat template) or spliced",
    "consistency": "Does this prompt start with the parent's prompt + response ids?",
}


def step_columns() -> dict:
    """The steps table's column labels; ``api`` names the protocols installed (other packages' included)."""
    names = ", ".join([p.api for p in protocols()] + ["control"])
    return {**STEP_COLUMNS, "api": f"The protocol the agent spoke: {names}"}


def metadata(db_name: str | list[str]) -> dict:
    names = [db_name] if isinstance(db_name, str) else db_name
    return {
        "title": "stepmill",
        "description": "Agents' LLM calls as RL step records. Each step links to a readable view.",
        "databases": {
            name: {
                "description": "Captured steps, trajectories and groups.",
                "tables": {
                    "steps": {
                        "title": "Steps (one per LLM call)",
                        "description": "One row per LLM call. Conversations are stored as a suffix after the "
                                       "parent's; the readable view and the export rebuild them whole.",
                        "facets": ["model", "api", "status", "channel", "trajectory_id"],
                        "sort_desc": "started_at",
                        "columns": step_columns(),
                    },
                    "trajectories": {
                        "title": "Trajectories (one per agent run)",
                        "facets": ["status", "channel", "source", "group_id"],
                        "sort_desc": "created_at",
                    },
                    "step_quality": {
                        "title": "Quality signals per step",
                        "description": "Always current (a view): truncated, failed, empty, token provenance and "
                                       "consistency, duplicate, reward present, staleness against the current "
                                       "policy version, trajectory complete.",
                        "facets": ["truncated", "status", "empty_completion", "token_provenance", "consistency",
                                   "duplicate", "reward_present", "staleness", "trajectory_complete"],
                    },
                    "trajectory_quality": {"title": "Quality summary per trajectory",
                                           "facets": ["status", "label", "channel"]},
                    "rewards": {"title": "Rewards (append-only history)", "facets": ["source", "name", "target_kind"],
                                "sort_desc": "id"},
                    "reviews": {"title": "Reviews (append-only history)", "facets": ["action", "value", "reviewer"],
                                "sort_desc": "id"},
                    "blobs": {"hidden": True},
                    "reviewers": {"hidden": True},
                    "schema_migrations": {"hidden": True},
                },
            } for name in names
        },
    }


def config(db_name: str | list[str]) -> dict:
    """Datasette's settings for the database(s): the stored queries listed beside each one's tables."""
    names = [db_name] if isinstance(db_name, str) else db_name
    return {"databases": {name: {"queries": {key: dict(query) for key, query in views.STORED_QUERIES.items()}}
                          for name in names}}


def database_names(paths: list[str]) -> list[str]:
    """The names Datasette gives the files: the file's stem, ``_2``, ``_3``… added to a repeated one
    (two nodes' ``steps.db``)."""
    names: list[str] = []
    for path in paths:
        stem, name, suffix = Path(path).stem, Path(path).stem, 2
        while name in names:
            name, suffix = f"{stem}_{suffix}", suffix + 1
        names.append(name)
    return names


def serve_args(db_path: str | list[str], folder: str | Path, *, host: str, port: int) -> list[str]:
    """Arguments for ``datasette`` serving one stepmill database, or several (a fleet's nodes' files: the
    pages find the file that holds an id, the lifecycle page takes ``?db=``); its configuration is
    written to ``folder``.

    ``--root`` makes Datasette print a one-time sign-in link for the local user. Anonymous visitors
    see nothing, on localhost too (agents on this machine must not read answers): everyone signs in.
    The plugin's ASGI gate enforces it for every route; ``allow`` makes Datasette's own permissions agree.
    """
    paths = [str(db_path)] if isinstance(db_path, (str, Path)) else [str(p) for p in db_path]
    names = database_names(paths)
    folder = Path(folder)
    settings = config(names)
    settings["allow"] = {"id": "*"}  # any signed-in actor; nobody anonymous
    (folder / "metadata.json").write_text(json.dumps(metadata(names)))
    (folder / "datasette.json").write_text(json.dumps(settings))
    return ["serve", *paths, "--host", host, "--port", str(port), "--root",
            "-m", str(folder / "metadata.json"), "-c", str(folder / "datasette.json")]
