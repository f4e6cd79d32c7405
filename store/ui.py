"""Datasette configuration for a stepmill database: labels, facets, stored queries."""

from __future__ import annotations

import json
from pathlib import Path

STEP_COLUMNS = {
    "id": "Step id; open /-/stepmill/steps/<id> for the readable conversation",
    "trajectory_id": "One agent run",
    "group_id": "Runs of the same prompt (GRPO group)",
    "parent_step_id": "The step whose conversation this one continues",
    "step_index": "Position in the trajectory",
    "api": "openai.chat, openai.completions, openai.responses, anthropic.messages, control",
    "transport": "http, sse or websocket",
    "messages_base_len": "Messages shared with the parent's conversation + completion",
    "messages_suffix": "Messages after the shared prefix (canonical form)",
    "completion": "The assistant message (canonical form)",
    "status": "ok, error or incomplete",
    "ttft_ms": "Time to first token",
    "token_provenance": "none, exact (from the engine), rendered (chat template) or spliced",
    "consistency": "Does this prompt start with the parent's prompt + response ids?",
}


def metadata(db_name: str) -> dict:
    return {
        "title": "stepmill",
        "description": "Agents' LLM calls as RL step records. Each step links to a readable view.",
        "databases": {
            db_name: {
                "description": "Captured steps, trajectories and groups.",
                "tables": {
                    "steps": {
                        "title": "Steps (one per LLM call)",
                        "description": "One row per LLM call. Conversations are stored as a suffix after the "
                                       "parent's; the readable view and the export rebuild them whole.",
                        "facets": ["model", "api", "status", "channel", "trajectory_id"],
                        "sort_desc": "started_at",
                        "columns": STEP_COLUMNS,
                    },
                    "trajectories": {
                        "title": "Trajectories (one per agent run)",
                        "facets": ["status", "channel", "source", "group_id"],
                        "sort_desc": "created_at",
                    },
                    "blobs": {"hidden": True},
                    "schema_migrations": {"hidden": True},
                },
            }
        },
    }


def config(db_name: str) -> dict:
    return {
        "databases": {
            db_name: {
                "queries": {
                    "recent_steps": {
                        "title": "Recent steps",
                        "sql": "select id, trajectory_id, step_index, api, model, status, finish_reason, "
                               "input_tokens, output_tokens, ttft_ms, started_at from steps "
                               "order by started_at desc limit 100",
                    },
                    "trajectory_summary": {
                        "title": "Trajectories with step counts",
                        "sql": "select t.id, t.group_id, t.status, t.reward, count(s.id) as steps, "
                               "sum(s.status != 'ok') as failed_steps, min(s.started_at) as first_step "
                               "from trajectories t left join steps s on s.trajectory_id = t.id "
                               "group by t.id order by first_step desc",
                    },
                }
            }
        }
    }


def serve_args(db_path: str, folder: str | Path, *, host: str, port: int) -> list[str]:
    """Arguments for ``datasette`` serving one stepmill database; its configuration is written to ``folder``."""
    name = Path(db_path).stem
    folder = Path(folder)
    (folder / "metadata.json").write_text(json.dumps(metadata(name)))
    (folder / "datasette.json").write_text(json.dumps(config(name)))
    return ["serve", str(db_path), "--host", host, "--port", str(port),
            "-m", str(folder / "metadata.json"), "-c", str(folder / "datasette.json")]
