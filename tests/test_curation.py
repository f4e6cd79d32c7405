"""Rewards, end-user feedback, reviews and the curation gate, on steps captured through the proxy."""

import json
import subprocess

import pytest

from stepmill.client import ControlError

from .conftest import STEPMILL


@pytest.fixture
def captured(proxy, openai_client, anthropic_client, marker):
    """One call of each API: their upstream response ids are what apps hold."""
    chat = openai_client.chat.completions.create(model="gpt-test", messages=[
        {"role": "user", "content": f"chat {marker}"}])
    message = anthropic_client.messages.create(model="claude-test", max_tokens=20, messages=[
        {"role": "user", "content": f"anthropic {marker}"}])
    response = openai_client.responses.create(model="gpt-5-test", input=f"responses {marker}")
    steps = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"], count=3)
    return {"chat": chat.id, "anthropic": message.id, "responses": response.id,
            "steps": {s["response_id"]: s for s in steps}}


def test_feedback_by_each_kind_of_response_id(proxy, captured):
    client = proxy.client()
    for kind, thumbs in (("chat", "up"), ("anthropic", "down"), ("responses", "up")):
        response_id = captured[kind]
        first = client.feedback(response_id=response_id, thumbs=thumbs, comment=f"{kind} was fine")
        again = client.feedback(response_id=response_id, thumbs=thumbs, comment=f"{kind} was fine")
        assert first["id"] == again["id"], "sent twice, stored once"
        step = captured["steps"][response_id]
        assert first["target_kind"] == "step" and first["target_id"] == step["step_id"]
        assert first["source"] == "human" and first["value"] == (1.0 if thumbs == "up" else -1.0)
        assert client.step(step["step_id"])["reward"] == first["value"]
    keyed = client.feedback(response_id=captured["chat"], score=0.25, idempotency_key="app-event-1")
    assert client.feedback(response_id=captured["chat"], score=0.9, idempotency_key="app-event-1")["id"] == keyed["id"]
    history = client.curation(captured["chat"])
    assert [r["value"] for r in history["rewards"]] == [1.0, 0.25] and history["reward"] == 0.25
    with pytest.raises(ControlError) as unknown:
        client.feedback(response_id="chatcmpl-nope", thumbs="up")
    assert unknown.value.status == 404
    with pytest.raises(ControlError) as anonymous:
        proxy.client(token="not-the-token").feedback(response_id=captured["chat"], thumbs="up")
    assert anonymous.value.status == 401
    with pytest.raises(ControlError) as both:
        client.feedback(response_id=captured["chat"], thumbs="up", score=1)
    assert both.value.status == 400


def test_effective_reward_prefers_the_latest_human_value(proxy, captured):
    client = proxy.client()
    step_id = captured["steps"][captured["chat"]]["step_id"]
    client.reward(step_id, 0.5, source="rule", name="math_match")
    client.reward(step_id, 0.2, source="human", name="ana")
    client.reward(step_id, 0.9, source="model", name="judge")
    state = client.curation(step_id)
    assert state["reward"] == 0.2 and [r["source"] for r in state["rewards"]] == ["rule", "human", "model"]
    trajectory = captured["steps"][captured["anthropic"]]["trajectory_id"]
    client.reward(trajectory, 0.7, source="env")
    assert client.step(captured["steps"][captured["anthropic"]]["step_id"])["reward"] == 0.7  # from its trajectory
    with pytest.raises(ControlError) as error:
        client.reward("s-unknown", 1.0)
    assert error.value.status == 404


def test_cli_reward_and_review_reach_the_export(proxy, captured, tmp_path):
    def run(*args):
        return subprocess.run(STEPMILL + [*args, "--db", str(proxy.db)], capture_output=True, text=True, timeout=60)

    done = run("reward", captured["responses"], "1.0", "--note", "correct")
    assert done.returncode == 0 and "reward 1.0 (human)" in done.stdout
    missing = run("reward", "resp_unknown", "1.0")
    assert missing.returncode != 0 and "no step, trajectory or upstream response 'resp_unknown'" in missing.stderr

    bad = captured["steps"][captured["chat"]]
    untrainable = captured["steps"][captured["anthropic"]]
    assert run("review", bad["step_id"], "--label", "bad", "--note", "wrong tool").returncode == 0
    assert run("review", untrainable["trajectory_id"], "--untrainable").returncode == 0
    where = ["--where", "s.id IN (:a, :b, :c)", "-p", "a", bad["step_id"], "-p", "b", untrainable["step_id"],
             "-p", "c", captured["steps"][captured["responses"]]["step_id"]]
    gated = run("export", *where)
    exported = [json.loads(line) for line in gated.stdout.splitlines()]
    assert [s["response_id"] for s in exported] == [captured["responses"]]
    assert exported[0]["reward"] == 1.0
    assert "removed 2: 1 step rejected, 1 trajectory untrainable" in gated.stderr
    everything = run("export", "--no-gate", *where)
    assert len(everything.stdout.splitlines()) == 3 and "would remove 2" in everything.stderr
    # a later review changes the next export
    assert run("review", bad["step_id"], "--label", "good").returncode == 0
    assert len(run("export", *where).stdout.splitlines()) == 2
