"""Datasette configuration for a stepmill database: labels, facets, stored queries."""

from __future__ import annotations

import json
from pathlib import Path

from stepmill.ui.lifecycle import AGENT, HEADERS_JOIN, USER_AGENT

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
                    "search": {
                        "title": "Search conversations and completions",
                        "description": 'Full-text (SQLite FTS5), e.g. "rm -rf" with the quotes',
                        "sql": "select s.id, s.trajectory_id, s.step_index, s.model, s.status, "
                               "snippet(steps_fts, -1, '[', ']', '…', 12) as match from steps_fts "
                               "join steps s on s.rowid = steps_fts.rowid where steps_fts match :q "
                               "order by rank limit 200",
                    },
                    "unreviewed": {
                        "title": "Unreviewed trajectories",
                        "sql": "select t.id, t.group_id, t.status, t.reward, t.created_at from trajectories t "
                               "where not exists (select 1 from reviews r where r.target_kind = 'trajectory' and "
                               "r.target_id = t.id) and not exists (select 1 from reviews r join steps s on "
                               "r.target_kind = 'step' and r.target_id = s.id where s.trajectory_id = t.id) "
                               "order by t.created_at desc limit 500",
                    },
                    "failed": {"title": "Failed and incomplete steps",
                               "sql": "select id, trajectory_id, status, error, model, started_at from steps "
                                      "where status != 'ok' order by started_at desc limit 500"},
                    "truncated": {"title": "Truncated completions",
                                  "sql": "select id, trajectory_id, model, finish_reason, output_tokens from "
                                         "step_quality q join steps s using (id) where q.truncated order by "
                                         "q.started_at desc limit 500"},
                    "drifted": {"title": "Token drift (a child that does not continue its parent's ids)",
                                "sql": "select id, trajectory_id, divergence_pos, divergence_reason, token_provenance "
                                       "from steps where consistency = 'divergent' order by started_at desc limit 500"},
                    "reward_missing": {"title": "Completed trajectories without a reward",
                                       "sql": "select id, group_id, completed_at from trajectories where status = "
                                              "'complete' and reward is null order by completed_at desc limit 500"},
                    "stale": {"title": "Steps from older policy versions",
                              "sql": "select id, trajectory_id, staleness from step_quality where staleness > 0 "
                                     "order by staleness desc limit 500"},
                    "by_agent": {"title": "Steps by agent (the runner's name; user agent beside)",
                                 "sql": f"select {AGENT} as agent, {USER_AGENT} as user_agent, count(*) as steps, "
                                        "sum(s.status != 'ok') as failed, sum(s.token_provenance = 'exact') as "
                                        "exact_ids from steps s left join trajectories t on t.id = s.trajectory_id "
                                        f"{HEADERS_JOIN} group by 1, 2 order by steps desc"},
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
    """Arguments for ``datasette`` serving one stepmill database; its configuration is written to ``folder``.

    ``--root`` makes Datasette print a one-time sign-in link for the local user. Anonymous visitors
    see nothing, on localhost too (agents on this machine must not read answers): everyone signs in.
    The plugin's ASGI gate enforces it for every route; ``allow`` makes Datasette's own permissions agree.
    """
    name = Path(db_path).stem
    folder = Path(folder)
    settings = config(name)
    settings["allow"] = {"id": "*"}  # any signed-in actor; nobody anonymous
    (folder / "metadata.json").write_text(json.dumps(metadata(name)))
    (folder / "datasette.json").write_text(json.dumps(settings))
    return ["serve", str(db_path), "--host", host, "--port", str(port), "--root",
            "-m", str(folder / "metadata.json"), "-c", str(folder / "datasette.json")]
