"""Linking with real agents' habits: per-request system content (Claude Code's billing header),
and n concurrent untagged rollouts of one prompt that must not cross."""

import concurrent.futures
import ssl
import uuid

import httpx2
import openai

TOOL = {"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                "parameters": {"type": "object", "properties": {}}}}


def billing_header() -> dict:
    """What Claude Code 2.1.x puts first in `system`: different on every call."""
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.14.{uuid.uuid4().hex[:3]}; "
                                    f"cch={uuid.uuid4().hex[:5]}; cc_prev_req=req_011C{uuid.uuid4().hex[:20]};"}


def test_claude_code_tool_loop_links_despite_volatile_system(proxy, anthropic_client, marker):
    session = f"cc-session-{marker}"
    system = lambda: [billing_header(), {"type": "text", "text": "You are Claude Code, Anthropic's CLI.",  # noqa: E731
                                         "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": f"weather in Paris? {marker}"}]
    kwargs = dict(model="claude-test", max_tokens=500, tools=[TOOL],
                  extra_headers={"X-Claude-Code-Session-Id": session})
    with anthropic_client.messages.stream(messages=messages, system=system(), **kwargs) as stream:
        first = stream.get_final_message()
    tool_use = next(b for b in first.content if b.type == "tool_use")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "rainy"}]}]
    with anthropic_client.messages.stream(messages=messages, system=system(), **kwargs) as stream:
        stream.get_final_message()
    one, two = proxy.trajectory_steps(session, 2)
    assert two["parent_step_id"] == one["step_id"], "turn 2 continues turn 1"
    assert two["system_changed"] is True and one["system_changed"] is None
    assert "the system prompt differs from the parent step's" in two["metadata"]["notes"]
    assert one["group_id"] == two["group_id"]


def test_untagged_volatile_system_still_links(proxy, openai_client, marker):
    """No session, no tags: a timestamp in the system prompt does not break the chain."""
    messages = [{"role": "user", "content": f"no tools {marker}"}]
    sys1 = {"role": "system", "content": "You are helpful. Current time: 2026-11-30T11:00:01.123Z"}
    answer = openai_client.chat.completions.create(model="gpt-test", messages=[sys1] + messages)
    sys2 = {"role": "system", "content": "You are helpful. Current time: 2026-11-30T11:00:07.456Z"}
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "and more"}]
    openai_client.chat.completions.create(model="gpt-test", messages=[sys2] + messages)
    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    one, two = proxy.trajectory_steps(root["trajectory_id"], 2)
    assert two["parent_step_id"] == one["step_id"] and two["system_changed"] is True


def test_engine_ids_locate_a_system_change(proxy, marker):
    """With exact ids the changed system prompt is a located divergence, not a silent one."""
    engine = openai.OpenAI(api_key="sk-x", base_url="https://engine.local/v1", max_retries=0)
    user = {"role": "user", "content": f"ids and time {marker}"}
    first = engine.chat.completions.create(model="qwen-engine", messages=[
        {"role": "system", "content": "Time: 2026-11-30T11:00:01Z"}, user])
    second_messages = [{"role": "system", "content": "Time: 2026-11-30T11:00:09Z"}, user,
                       {"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "go on"}]
    engine.chat.completions.create(model="qwen-engine", messages=second_messages)
    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    one, two = proxy.trajectory_steps(root["trajectory_id"], 2)
    check = two["token_check"]
    assert two["parent_step_id"] == one["step_id"]
    assert check["consistency"] == "divergent"
    assert check["divergence_pos"] == len("<system>Time: 2026-11-30T11:00:0")  # the changed digit
    assert "system prompt changed" in check["divergence_reason"]


def _rollout(proxy, prompt: str, shared_pool: httpx2.Client | None):
    http = shared_pool or httpx2.Client(proxy=proxy.url, timeout=30,
                                        verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]))
    client = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", http_client=http, max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    reply = client.chat.completions.create(model="gpt-test", messages=messages, tools=[OPENAI_TOOL])
    call = reply.choices[0].message.tool_calls[0]
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    # Identical first turns (a fixed tool call): the second turns differ only by their own call id.
    return client.chat.completions.create(model="gpt-test", messages=messages, tools=[OPENAI_TOOL]).id


def test_concurrent_identical_rollouts_stay_apart(proxy, marker):
    prompt = f"weather for rollout? {marker}"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        finals = list(pool.map(lambda _: _rollout(proxy, prompt, None), range(8)))
    steps = proxy.steps("s.trajectory_id IN (SELECT trajectory_id FROM steps WHERE messages_suffix LIKE ?)",
                        [f"%{marker}%"], count=16)
    by_trajectory = {}
    for step in steps:
        by_trajectory.setdefault(step["trajectory_id"], []).append(step)
    assert len(by_trajectory) == 8
    for trajectory in by_trajectory.values():
        assert sorted(s["step_index"] for s in trajectory) == [0, 1]
        first, second = sorted(trajectory, key=lambda s: s["step_index"])
        assert second["parent_step_id"] == first["step_id"]
        # the turn-2 request carried turn 1's own tool call id: the parent is its own turn 1
        assert second["messages"][1]["tool_calls"][0]["id"] == first["completion"]["tool_calls"][0]["id"]
    assert len({s["group_id"] for s in steps}) == 1  # one prompt, one GRPO group
    assert {s["response_id"] for s in steps} >= set(finals)


def test_group_and_channel_set_later_apply_to_all_steps(proxy, openai_client, marker):
    client = proxy.client()
    run = client.start_trajectory(trajectory_id=f"later-{marker}")
    tagged = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", max_retries=0,
                           default_headers={"X-Stepmill-Trajectory": run["trajectory_id"]})
    tagged.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"a {marker}"}])
    client.update_trajectory(run["trajectory_id"], group_id=f"grp-{marker}", channel="eval")
    tagged.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"b {marker}"}])
    steps = proxy.trajectory_steps(run["trajectory_id"], 2)
    assert {(s["group_id"], s["channel"]) for s in steps} == {(f"grp-{marker}", "eval")}
    stats = proxy.store().query("SELECT DISTINCT s.group_id, s.channel, t.group_id AS tg, t.channel AS tc FROM steps s"
                                " JOIN trajectories t ON t.id = s.trajectory_id WHERE t.id = ?", [run["trajectory_id"]])
    assert stats == [{"group_id": f"grp-{marker}", "channel": "eval", "tg": f"grp-{marker}", "tc": "eval"}]
