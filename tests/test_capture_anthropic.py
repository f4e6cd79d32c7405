"""Anthropic Messages through the proxy with the real anthropic SDK."""

import json

from stepmill.store.encoding import loads

TOOL = {"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
SYSTEM = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]


def test_plain_message(proxy, anthropic_client, marker):
    reply = anthropic_client.messages.create(model="claude-test", max_tokens=100, system="Be kind.",
                                             messages=[{"role": "user", "content": f"hi {marker}"}])
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["api"] == "anthropic.messages" and step["host"] == "api.anthropic.com"
    assert step["messages"] == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": f"hi {marker}"}]
    assert step["completion"] == {"role": "assistant", "content": reply.content[0].text}
    assert step["finish_reason"] == "end_turn" and step["response_id"] == reply.id
    assert step["usage"]["cache_read_tokens"] == 25 and step["usage"]["cache_write_tokens"] == 5


def test_streamed_tool_loop_with_thinking(proxy, anthropic_client, marker):
    messages = [{"role": "user", "content": [{"type": "text", "text": f"weather? {marker}",
                                               "cache_control": {"type": "ephemeral"}}]}]
    kwargs = dict(model="claude-test", max_tokens=1000, system=SYSTEM, tools=[TOOL],
                  thinking={"type": "enabled", "budget_tokens": 500})
    with anthropic_client.messages.stream(messages=messages, **kwargs) as stream:
        first = stream.get_final_message()
    tool_use = next(b for b in first.content if b.type == "tool_use")
    assert tool_use.input == {"city": "Paris", "days": 2}
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                  "content": [{"type": "text", "text": "rainy"}]}]})
    with anthropic_client.messages.stream(messages=messages, **kwargs) as stream:
        second = stream.get_final_message()
    assert "rainy" in second.content[-1].text

    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    one, two = proxy.trajectory_steps(root["trajectory_id"], 2)
    assert one["transport"] == "sse" and one["status"] == "ok"
    assert one["messages"][0] == {"role": "system", "content": "You are terse."}
    completion = one["completion"]
    assert completion["reasoning_content"] == "Let me look at the weather tool."
    assert completion["content"] == "Checking."
    assert completion["tool_calls"] == [{"id": tool_use.id, "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]
    assert one["finish_reason"] == "tool_use"
    # The wire form keeps what canonical messages cannot: signatures, redacted thinking, cache markers.
    store = proxy.store()
    wire = loads(store.query("SELECT wire_completion FROM steps WHERE id = ?", [one["step_id"]])[0]["wire_completion"])
    kinds = [b["type"] for b in wire[0]["content"]]
    assert kinds == ["thinking", "redacted_thinking", "text", "tool_use"]
    assert wire[0]["content"][0]["signature"].startswith("sig-")
    assert store.wire_messages(two["step_id"])[0]["content"][0]["cache_control"] == {"type": "ephemeral"}
    assert store.query("SELECT body FROM blobs WHERE hash = (SELECT request_hash FROM steps WHERE id = ?)",
                       [one["step_id"]])[0]["body"].count("cache_control") == 1

    assert two["parent_step_id"] == one["step_id"] and two["step_index"] == 1
    assert two["messages"][-1] == {"role": "tool", "tool_call_id": tool_use.id, "content": "rainy"}
    assert two["messages"][2]["reasoning_content"] == "Let me look at the weather tool."


def test_beta_path_and_session_header(proxy, anthropic_client, marker):
    session = f"sess-{marker}"
    for turn in range(2):
        anthropic_client.beta.messages.create(
            model="claude-test", max_tokens=50, messages=[{"role": "user", "content": f"turn {turn} {marker}"}],
            extra_headers={"X-Claude-Code-Session-Id": session})
    steps = proxy.trajectory_steps(session, 2)
    assert [s["step_index"] for s in steps] == [0, 1]
    # Unrelated conversations in one session are separate branches: neither is the other's parent.
    assert steps[1]["parent_step_id"] is None


def test_metadata_user_id_session(proxy, anthropic_client, marker):
    anthropic_client.messages.create(
        model="claude-test", max_tokens=50, messages=[{"role": "user", "content": f"meta {marker}"}],
        metadata={"user_id": f"user_abc_account_def_session_{marker}0000"})
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["trajectory_id"] == f"{marker}0000"
