"""The store's surface: what callers call of it exists, each name forwards to the part that does it,
and the methods callers use instead of SQL behave."""

import ast
import sqlite3
from pathlib import Path

import pytest

from stepmill.errors import BadInput, Conflict, NotFound, StoreUnavailable
from stepmill.store import StepRecord, Store
from stepmill.store.db import forward

ROOT = Path(__file__).resolve().parent.parent
USER = [{"role": "user", "content": "q"}]
ANSWER = {"role": "assistant", "content": "a"}


def _forwards() -> dict[str, forward]:
    return {name: value for name, value in vars(Store).items() if isinstance(value, forward)}


def test_every_forward_reaches_the_method_of_the_part_the_store_built(tmp_path):
    store = Store(tmp_path / "f.db")
    forwards = _forwards()
    assert len(forwards) > 60
    for name, declared in forwards.items():
        part = getattr(store, declared.part)
        # the part built under that attribute is the class the forwarded function belongs to
        assert getattr(type(part), name) is declared.method, f"Store.{name} -> {declared.part}.{name}"
        assert getattr(store, name) == getattr(part, name)
    public = {name for name in vars(Store) if not name.startswith("_")}
    assert public == set(forwards), "a public method of Store that is not a forward to a part"


def _attributes_called_on_a_store() -> dict[str, str]:
    """``store.x`` / ``self.store.x`` / ``self._store.x`` anywhere in the tree: name -> a file using it."""
    found: dict[str, str] = {}
    for folder in ("stepmill", "addon", "trainer_bridge", "store", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Attribute):
                    continue
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "store") or (
                        isinstance(owner, ast.Attribute) and owner.attr in ("store", "_store")):
                    found.setdefault(node.attr, str(path.relative_to(ROOT)))
    return found


def test_everything_callers_use_of_a_store_exists(tmp_path):
    store = Store(tmp_path / "u.db")
    used = _attributes_called_on_a_store()
    assert {"record_steps", "policy_version", "iter_steps", "claim_groups", "curation"} <= set(used)
    missing = {name: where for name, where in used.items() if not hasattr(store, name)}
    assert not missing, f"called on a store, and Store has no such attribute: {missing}"


def test_data_version_changes_when_another_connection_commits(tmp_path):
    store, other = Store(tmp_path / "v.db"), Store(tmp_path / "v.db")
    before = store.data_version()
    assert store.data_version() == before
    other.set_policy_version("2")
    assert store.data_version() != before


def test_checkpoints(tmp_path):
    store = Store(tmp_path / "c.db")
    store.manage_checkpoints()
    assert store.db.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    store.record_step(StepRecord(api="openai.chat", messages=USER, completion=ANSWER))
    assert store.checkpoint("PASSIVE") is True
    assert store.checkpoint("TRUNCATE") is True
    with pytest.raises(BadInput):
        store.checkpoint("NOW; DROP TABLE steps")
    reader = sqlite3.connect(tmp_path / "c.db", isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM steps").fetchone()  # holds a snapshot of the WAL
    store.record_step(StepRecord(api="openai.chat", messages=USER, completion=ANSWER))
    store.db.conn.execute("PRAGMA busy_timeout = 50")
    assert store.checkpoint("TRUNCATE") is False
    reader.execute("ROLLBACK")


def test_set_state_joins_a_batch(tmp_path):
    store = Store(tmp_path / "b.db")
    with store.batch():
        step_id = store.record_step(StepRecord(api="openai.chat", messages=USER, completion=ANSWER))
        store.set_state("journal:x", "1:10")
    assert Store(tmp_path / "b.db").get_state("journal:x") == "1:10"
    assert store.trajectory_of_step(step_id)
    with pytest.raises(RuntimeError), store.batch():
        store.set_state("journal:x", "1:20")
        raise RuntimeError("the batch fails")
    assert store.get_state("journal:x") == "1:10"  # undone with the batch
    assert store.journal_positions() == {"journal:x": "1:10"}
    store.set_state("journal:x", None)
    assert store.journal_positions() == {}


def test_step_lookups(tmp_path):
    store = Store(tmp_path / "l.db")
    first = store.record_step(StepRecord(api="openai.chat", messages=USER, completion=ANSWER, response_id="r-1",
                                         trajectory_id="t-1", prompt_ids=[1, 2], response_ids=[3],
                                         token_provenance="exact"))
    again = store.record_step(StepRecord(api="openai.chat", messages=USER + [ANSWER], completion=ANSWER,
                                         response_id="r-1", trajectory_id="t-1", prompt_ids=[1, 2, 3, 4],
                                         response_ids=[5], token_provenance="exact"))
    assert store.step_for_response("r-1") == again
    assert store.step_for_response("r-none") is None
    assert store.trajectory_of_step(first) == "t-1"
    assert store.trajectory_of_step("s-none") is None
    assert store.last_step("t-1") == again
    assert store.last_step("t-none") is None
    assert sorted(store.step_ids("t-1")) == sorted([first, again])
    # equal indexes: the later written is the last
    late = store.record_step(StepRecord(api="openai.chat", messages=[{"role": "user", "content": "other"}],
                                        trajectory_id="t-1", step_index=1))
    assert store.last_step("t-1") == late
    summary = store.step_summary(again)
    assert summary == {"step_id": again, "trajectory_id": "t-1", "group_id": summary["group_id"],
                       "parent_step_id": first, "step_index": 1, "consistency": "consistent",
                       "divergence_pos": None, "divergence_reason": None}
    with pytest.raises(NotFound):
        store.step_summary("s-none")
    assert store.token_layout(again) == {"token_provenance": "exact", "message_count": 2, "messages_base_len": 2}
    with pytest.raises(NotFound):
        store.token_layout("s-none")


def test_steps_to_tokenize_never_selects_exact_ids(tmp_path):
    store = Store(tmp_path / "k.db")
    exact = store.record_step(StepRecord(api="openai.chat", messages=USER, completion=ANSWER, prompt_ids=[1],
                                         response_ids=[2], token_provenance="exact"))
    plain = store.record_step(StepRecord(api="openai.chat", messages=[{"role": "user", "content": "p"}],
                                         completion=ANSWER))
    store.record_step(StepRecord(api="openai.chat", messages=[{"role": "user", "content": "no answer"}]))
    assert store.steps_to_tokenize() == [plain]
    assert exact not in store.steps_to_tokenize("1 OR 1")
    store.set_tokens(plain, [7], [8], provenance="rendered")
    assert store.steps_to_tokenize() == []
    assert store.steps_to_tokenize(redo=True) == [plain]
    assert store.steps_to_tokenize("s.id = ?", [exact]) == []


def test_errors_say_what_went_wrong(tmp_path):
    with pytest.raises(StoreUnavailable, match="no stepmill database"):
        Store(tmp_path / "missing.db", readonly=True)
    store = Store(tmp_path / "e.db")
    store.start_trajectory(trajectory_id="t-1")
    with pytest.raises(Conflict, match="trajectory 't-1' already exists"):
        store.start_trajectory(trajectory_id="t-1")
    for call in (lambda: store.update_trajectory("t-none", channel="val"),
                 lambda: store.complete_trajectory("t-none"),
                 lambda: store.register_run("t-none", "hash"),
                 lambda: store.add_reward("t-none", 1.0),
                 lambda: store.add_review("t-none", "label", "good", reviewer="r"),
                 lambda: store.curation("t-none"),
                 lambda: store.step("s-none"),
                 lambda: store.messages("s-none")):
        with pytest.raises(NotFound):
            call()
    with pytest.raises(BadInput, match="a label is one of"):
        store.add_review("t-1", "label", "fine", reviewer="r")
    step_id = store.record_step(StepRecord(api="openai.chat", messages=USER, completion=ANSWER))
    with pytest.raises(BadInput, match="logprobs has 1 values for 2 response ids"):
        store.set_tokens(step_id, [1], [2, 3], [0.0], provenance="rendered")
    with pytest.raises(BadInput, match="parent step 's-none' does not exist"):
        store.record_step(StepRecord(api="openai.chat", messages=USER, parent_step_id="s-none"))
    with pytest.raises(BadInput, match="status must be one of"):
        store.record_step(StepRecord(api="openai.chat", messages=USER, status="weird"))
    with pytest.raises(StoreUnavailable, match="was opened read-only"):
        Store(tmp_path / "e.db", readonly=True).set_policy_version("3")


def test_what_scoring_the_runner_and_the_demo_ask(tmp_path):
    store = Store(tmp_path / "r.db")
    for trajectory_id, agent, outcome in (("run-a-1", "a", "ok"), ("run-a-2", "b", "timeout"), ("other-1", "a", "ok")):
        store.start_trajectory(trajectory_id=trajectory_id, group_id="grp",
                               metadata={"agent": agent, "outcome": outcome})
        store.record_step(StepRecord(api="openai.chat", messages=[{"role": "user", "content": trajectory_id}],
                                     completion=ANSWER, trajectory_id=trajectory_id, usage={"output_tokens": 5},
                                     is_last=True))
    assert [row["id"] for row in store.completed_trajectories(id_prefix="run-a-")] == ["run-a-1", "run-a-2"]
    assert [row["id"] for row in store.completed_trajectories("t.id = :id", {"id": "other-1"})] == ["other-1"]
    assert store.completed_trajectories("t.id = ?", ["other-1"])[0]["metadata"] == {"agent": "a", "outcome": "ok"}
    assert store.rollout_totals("run-a-") == {"steps": 2, "output_tokens": 10}
    assert store.rollout_totals("run-a_") == {"steps": 0, "output_tokens": 0}  # a prefix, not a pattern
    store.add_trajectory_rewards([("run-a-1", 1.0, None), ("run-a-2", None, {"error": "boom"})], source="rule",
                                 name="math")
    assert store.rewarded_trajectories("math") == {"run-a-1"}
    assert store.trajectory("run-a-1")["reward"] == 1.0
    assert sorted(store.trajectories_in_group("grp")) == ["other-1", "run-a-1", "run-a-2"]
    assert store.unsuccessful_runs() == ["run-a-2"]
    by_agent = {row["agent"]: row for row in store.steps_by_agent()}
    assert by_agent["a"]["runs"] == 2 and by_agent["a"]["output_tokens"] == 10
    assert store.rewards_by_agent() == [{"agent": "a", "n": 1, "mean": 1.0, "right": 1}]
    assert store.group_reward_ranges() == [{"group_id": "grp", "n": 3, "lo": 1.0, "hi": 1.0}]


def test_a_users_bad_condition_is_bad_input_wherever_it_is_applied(tmp_path):
    store = Store(tmp_path / "w.db")
    store.record_step(StepRecord(api="openai.chat", messages=USER, completion=ANSWER, trajectory_id="t-1"))
    store.complete_trajectory("t-1")
    calls = {"iter_steps": lambda where, params: list(store.iter_steps(where, params)),
             "step_shards": lambda where, params: store.step_shards(10, where, params),
             "gate_counts": store.gate_counts,
             "completed_trajectories": store.completed_trajectories,
             "steps_to_tokenize": store.steps_to_tokenize}
    for name, call in calls.items():
        with pytest.raises(BadInput, match=r"^--where 's.nope = 1': no such column: s.nope$"):
            call("s.nope = 1", ())
        with pytest.raises(BadInput, match=r"^--where \"json\('nope'\)\": malformed JSON$"):
            call("json('nope')", ())  # refused when it runs, not when the query is prepared
        with pytest.raises(BadInput, match=r"^--where 't.id = :x': "):
            call("t.id = :x", {})  # a parameter the user named and did not give
        assert call("1", ()) is not None, name


def test_steps_of_some_runs(tmp_path):
    store = Store(tmp_path / "s.db")
    for run in ("t-1", "t-2", "t-3"):
        store.record_step(StepRecord(api="openai.chat", messages=[{"role": "user", "content": run}],
                                     completion=ANSWER, trajectory_id=run, group_id="g"))

    def runs(*args, **kwargs):
        return sorted({step["trajectory_id"] for step in store.iter_steps(*args, with_tokens=False, **kwargs)})

    assert runs(trajectory_ids=["t-1", "t-3"]) == ["t-1", "t-3"]
    assert runs(trajectory_ids=[]) == []
    assert runs(trajectory_ids=None) == ["t-1", "t-2", "t-3"]
    assert runs("s.trajectory_id != ?", ["t-1"], trajectory_ids=["t-1", "t-2"], group_id="g") == ["t-2"]
    assert runs("s.trajectory_id != :t", {"t": "t-1"}, trajectory_ids=("t-1", "t-2")) == ["t-2"]
    assert runs(trajectory_ids=["t-1 OR 1"]) == []  # ids are bound, never SQL


def test_reviewers_sign_in_with_a_token_kept_only_as_its_hash(tmp_path):
    store = Store(tmp_path / "r.db")
    token = store.create_reviewer("ada")
    assert store.reviewer_for_token(token) == "ada"
    assert store.reviewer_for_token(token + "x") is None and store.reviewer_for_token("") is None
    assert token not in str(store.query("SELECT * FROM reviewers"))
    again = store.create_reviewer("ada")  # replaces the earlier one
    assert store.reviewer_for_token(again) == "ada" and store.reviewer_for_token(token) is None
    assert Store(tmp_path / "r.db", readonly=True).reviewer_for_token(again) == "ada"


def test_a_file_that_takes_no_writes_is_store_unavailable_and_keeps_nothing_half_written(tmp_path):
    store = Store(tmp_path / "f.db")
    store.set_state("journal:x", "1:1")
    pages = store.db.conn.execute("PRAGMA page_count").fetchone()[0]
    store.db.conn.execute(f"PRAGMA max_page_count = {pages}")  # a full disk, for this connection
    big = StepRecord(api="openai.chat", messages=[{"role": "user", "content": "x" * 200_000}], completion=ANSWER)
    with pytest.raises(StoreUnavailable, match="database or disk is full"):
        store.record_step(big)
    with pytest.raises(StoreUnavailable, match="database or disk is full"), store.batch():
        store.set_state("journal:x", "1:2")
        store.record_step(big)  # inside a batch: its savepoint says so too, never a bad record
    assert store.get_state("journal:x") == "1:1" and store.stats()["steps"] == 0
    store.db.conn.execute("PRAGMA max_page_count = 1073741823")
    store.db.conn.execute("PRAGMA query_only = 1")  # a read-only file
    with pytest.raises(StoreUnavailable, match="readonly database"):
        store.set_state("journal:x", "1:3")
    with pytest.raises(BadInput, match="--where"):  # what a user's condition asks stays the user's fault
        store.gate_counts("s.nope")


def test_a_policy_version_set_after_a_clock_step_back_still_comes_after(tmp_path, monkeypatch):
    import time

    store = Store(tmp_path / "p.db")
    store.set_policy_version("1")
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now - 3600)  # the clock stepped back an hour
    store.set_policy_version("2")
    monkeypatch.undo()
    assert store.policy_version_at(time.time()) == "2"
    assert store.policy_version_at(now - 7200) is None


def test_the_writers_batch_lookup_of_policy_versions_agrees_with_the_one_call_lookup(tmp_path):
    """``policy_versions_at`` (one query a batch, the history remembered) answers as ``policy_version_at``
    (one query a call), also for versions another process sets between the batches, at equal times and
    for a start time that is no number."""
    from hypothesis import given, settings, strategies as st

    path = tmp_path / "v.db"
    Store(path).close()
    times = st.floats(min_value=0, max_value=100, allow_nan=False)
    # a version set (or none), or a history changed by hand: cleared, a row whose time is NULL or text
    changes = st.one_of(st.none(), st.sampled_from("abc"), st.sampled_from(["clear", "null", "text"]))
    steps = st.lists(st.tuples(changes, times, st.lists(st.one_of(times, st.just("?")), max_size=5)), max_size=8)
    by_hand = {"clear": "DELETE FROM policy_versions",
               "null": "INSERT INTO policy_versions (set_at, version) VALUES (NULL, 'n')",
               "text": "INSERT INTO policy_versions (set_at, version) VALUES ('later', 't')"}

    @settings(max_examples=60, deadline=None)
    @given(steps)
    def check(history):
        setter, writer = Store(path), Store(path)  # the writer's store remembers; the setter is another process
        try:
            setter.db.conn.execute("DELETE FROM policy_versions")
            for version, since, asked in history:
                if version in by_hand:
                    setter.db.conn.execute(by_hand[version])
                elif version is not None:
                    setter.set_policy_version(version, since=since)
                expected = [writer.policy_version_at(when) for when in asked]
                assert writer.policy_versions_at(asked) == expected
        finally:
            setter.close()
            writer.close()

    check()


def test_a_batch_caches_what_it_wrote_only_once_it_commits(tmp_path):
    store = Store(tmp_path / "c.db")

    def cached_conversations() -> set:
        return {key for key in store.transactions.cache if key[0] in ("messages", "wire")}

    with pytest.raises(RuntimeError), store.batch():
        lost = store.record_step(StepRecord(api="openai.chat", messages=USER, completion=ANSWER))
        raise RuntimeError("the batch fails")
    assert not cached_conversations() and store.trajectory_of_step(lost) is None
    with store.batch():
        kept = store.record_step(StepRecord(api="openai.chat", messages=USER, completion=ANSWER))
        assert not cached_conversations()  # not before the commit
    assert cached_conversations() == {("messages", kept), ("wire", kept)}
    assert store.continuation(kept) == (USER + [ANSWER], [])
