"""Counts over the whole file (`stepmill stats`, the control API's /v1/stats) and over a rollout's runs."""

from __future__ import annotations

from stepmill.store.connection import Transactions
from stepmill.store.state import State


class Counts:
    """Counts of steps, trajectories, tokens, token checks and rewards (with ``state``'s policy version)."""

    def __init__(self, tx: Transactions, state: State):
        self.tx = tx
        self.state = state

    def stats(self) -> dict:
        conn = self.tx.conn

        def counts(column: str) -> dict:
            return {str(k): v for k, v in conn.execute(
                f"SELECT {column}, count(*) FROM steps GROUP BY 1 ORDER BY 2 DESC")}

        total = conn.execute("SELECT count(*) FROM steps").fetchone()[0]
        tokens = conn.execute(
            "SELECT coalesce(sum(input_tokens),0), coalesce(sum(output_tokens),0),"
            " coalesce(sum(cache_read_tokens),0), coalesce(sum(cache_write_tokens),0) FROM steps"
        ).fetchone()
        exact = conn.execute("SELECT count(*) FROM steps WHERE token_provenance = 'exact'").fetchone()[0]
        with_ids = conn.execute("SELECT count(*) FROM steps WHERE prompt_len IS NOT NULL").fetchone()[0]
        checked = conn.execute(
            "SELECT count(*), coalesce(sum(consistency = 'consistent'), 0) FROM steps"
            " WHERE consistency IN ('consistent', 'divergent')"
        ).fetchone()
        return {
            "steps": total,
            "trajectories": conn.execute("SELECT count(*) FROM trajectories").fetchone()[0],
            "groups": conn.execute("SELECT count(DISTINCT group_id) FROM trajectories").fetchone()[0],
            "by_api": counts("api"),
            "by_model": counts("model"),
            "by_status": counts("status"),
            "by_channel": counts("channel"),
            "by_token_provenance": counts("token_provenance"),
            "tokens": {"input": tokens[0], "output": tokens[1], "cache_read": tokens[2], "cache_write": tokens[3]},
            "steps_with_ids": with_ids,
            "exact_id_share": exact / total if total else None,
            "parent_child_pairs_checked": checked[0],
            "consistent_share": checked[1] / checked[0] if checked[0] else None,
            "policy_version": self.state.policy_version(),
        }

    def rollout_totals(self, id_prefix: str) -> dict:
        """Steps and output tokens so far of the trajectories whose id starts with ``id_prefix``."""
        row = self.tx.conn.execute(
            "SELECT count(*), coalesce(sum(s.output_tokens), 0) FROM steps s"
            " JOIN trajectories t ON t.id = s.trajectory_id WHERE substr(t.id, 1, ?) = ?",
            [len(id_prefix), id_prefix]).fetchone()
        return {"steps": row[0], "output_tokens": row[1]}

    def mean_trajectory_reward(self, id_prefix: str) -> float | None:
        """The mean effective reward of the complete trajectories whose ids start with ``id_prefix``."""
        rows = self.tx.query("SELECT avg(reward) AS mean FROM trajectories WHERE substr(id, 1, ?) = ? "
                             "AND status = 'complete' AND reward IS NOT NULL", [len(id_prefix), id_prefix])
        return rows[0]["mean"] if rows else None

    def steps_by_agent(self) -> list[dict]:
        """Per agent (the runner's ``metadata.agent``): runs, steps, steps with exact ids, steps whose ids
        continue their parent's, input and output tokens."""
        return self.tx.query("""SELECT json_extract(t.metadata, '$.agent') AS agent, count(DISTINCT t.id) AS runs,
                                    count(s.id) AS steps, sum(s.token_provenance = 'exact') AS exact,
                                    sum(s.consistency IN ('root', 'consistent')) AS consistent,
                                    sum(s.input_tokens) AS input_tokens, sum(s.output_tokens) AS output_tokens
                             FROM trajectories t JOIN steps s ON s.trajectory_id = t.id GROUP BY 1 ORDER BY 1""")

    def rewards_by_agent(self) -> list[dict]:
        """Per agent: rewarded trajectories (``n``), their mean reward and how many scored 1 (``right``)."""
        return self.tx.query("""SELECT json_extract(metadata, '$.agent') AS agent, count(*) AS n,
                                    avg(reward) AS mean, sum(reward = 1) AS right FROM trajectories
                             WHERE reward IS NOT NULL GROUP BY 1 ORDER BY 1""")

    def group_reward_ranges(self) -> list[dict]:
        """Per group: its trajectories (``n``) and their lowest and highest reward (``lo``, ``hi``)."""
        return self.tx.query("""SELECT group_id, count(*) AS n, min(reward) AS lo, max(reward) AS hi
                             FROM trajectories WHERE group_id IS NOT NULL GROUP BY group_id""")
