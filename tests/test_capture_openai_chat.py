"""OpenAI Chat Completions through the proxy with the real openai SDK."""

import json

import openai

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_plain_call_becomes_one_step(proxy, openai_client, marker):
    reply = openai_client.chat.completions.create(
        model="gpt-test", messages=[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": f"hello {marker}"}], temperature=0.3)
    assert reply.choices[0].message.content == f"Echo: hello {marker}"
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["api"] == "openai.chat" and step["transport"] == "http"
    assert step["host"] == "api.openai.com" and step["model"] == "gpt-test"
    assert step["status"] == "ok" and step["finish_reason"] == "stop"
    assert step["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": f"hello {marker}"}]
    assert step["completion"] == {"role": "assistant", "content": f"Echo: hello {marker}"}
    assert step["response_id"] == reply.id
    assert step["params"]["temperature"] == 0.3
    assert step["usage"]["input_tokens"] == reply.usage.prompt_tokens
    assert step["usage"]["cache_read_tokens"] == 3
    assert step["ttft_ms"] > 0 and step["duration_ms"] >= step["ttft_ms"]
    assert step["channel"] == "train" and step["step_index"] == 0 and step["parent_step_id"] is None


def test_streamed_call_is_reassembled(proxy, openai_client, marker):
    stream = openai_client.chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": f"stream please {marker}"}], stream=True,
        stream_options={"include_usage": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == f"Echo: stream please {marker}"
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["transport"] == "sse" and step["status"] == "ok"
    assert step["completion"]["content"] == text
    assert step["finish_reason"] == "stop"
    assert step["usage"]["output_tokens"] > 0


def _tool_loop(client, marker, stream):
    messages = [{"role": "user", "content": f"weather in Paris? {marker}"}]

    def call():
        if not stream:
            return client.chat.completions.create(model="gpt-test", messages=messages, tools=[WEATHER_TOOL]).choices[0].message
        calls, text = {}, ""
        for chunk in client.chat.completions.create(model="gpt-test", messages=messages, tools=[WEATHER_TOOL], stream=True):
            delta = chunk.choices[0].delta
            text += delta.content or ""
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.id or slot["id"]
                slot["function"]["name"] += tc.function.name or ""
                slot["function"]["arguments"] += tc.function.arguments or ""
        return {"role": "assistant", "content": text or None, "tool_calls": list(calls.values()) or None}

    first = call()
    tool_calls = first.tool_calls if not stream else first["tool_calls"]
    assert tool_calls, "the first turn should call the tool"
    messages.append(first.model_dump(exclude_none=True) if not stream else {k: v for k, v in first.items() if v is not None})
    call_id = tool_calls[0].id if not stream else tool_calls[0]["id"]
    messages.append({"role": "tool", "tool_call_id": call_id, "content": "18C and sunny"})
    second = call()
    return call_id, second


def test_tool_loop_is_one_trajectory_with_two_steps(proxy, openai_client, marker):
    call_id, second = _tool_loop(openai_client, marker, stream=False)
    assert second.content == "The tool said: 18C and sunny"
    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    first, child = proxy.trajectory_steps(root["trajectory_id"], 2)
    assert child["parent_step_id"] == first["step_id"] and child["step_index"] == 1
    assert child["group_id"] == first["group_id"]
    assert first["finish_reason"] == "tool_calls"
    assert first["completion"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}
    assert child["messages"][1]["tool_calls"][0]["id"] == call_id
    assert child["messages"][2] == {"role": "tool", "tool_call_id": call_id, "content": "18C and sunny"}
    assert child["tools"] == [WEATHER_TOOL]


def test_streamed_tool_loop_is_one_trajectory(proxy, openai_client, marker):
    _, second = _tool_loop(openai_client, marker, stream=True)
    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    first, child = proxy.trajectory_steps(root["trajectory_id"], 2)
    assert first["transport"] == child["transport"] == "sse"
    assert json.loads(first["completion"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert child["parent_step_id"] == first["step_id"]


def test_legacy_completions(proxy, openai_client, marker):
    reply = openai_client.completions.create(model="gpt-3.5-turbo-instruct", prompt=f"Once upon {marker}")
    [step] = proxy.steps("s.api = 'openai.completions' AND s.request_hash IN "
                         "(SELECT hash FROM blobs WHERE body LIKE ?)", [f"%{marker}%"])
    assert step["completion"]["content"] == reply.choices[0].text
    assert step["params"]["prompt"] == f"Once upon {marker}"


def test_secrets_are_never_written(proxy, openai_client, marker):
    openai_client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"secret {marker}"}])
    proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    data = proxy.db.read_bytes() + (proxy.db.with_name("steps.db-wal").read_bytes()
                                    if proxy.db.with_name("steps.db-wal").exists() else b"")
    assert b"sk-test-secret" not in data
    store = proxy.store()
    headers = json.loads(store.query("SELECT b.body FROM steps s JOIN blobs b ON b.hash = s.headers_hash"
                                     " WHERE s.messages_suffix LIKE ?", [f"%{marker}%"])[0]["body"])
    assert "authorization" not in headers and "user-agent" in headers


def test_n_choices_are_separate_rollouts_of_one_group(proxy, marker):
    """GRPO through `n`: each choice is its own rollout, in the prompt's group, with its own exact ids."""
    engine = openai.OpenAI(api_key="sk-x", base_url="https://engine.local/v1", max_retries=0)
    reply = engine.chat.completions.create(model="qwen-engine", n=3, messages=[{"role": "user", "content": f"n {marker}"}])
    assert len(reply.choices) == 3
    steps = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"], count=3)
    by_choice = {s["completion"]["content"]: s for s in steps}
    assert set(by_choice) == {c.message.content for c in reply.choices}
    assert len({s["trajectory_id"] for s in steps}) == 3 and len({s["group_id"] for s in steps}) == 1
    assert len({tuple(s["prompt_ids"]) for s in steps}) == 1
    assert all(s["response_ids"][:-1] == list(s["completion"]["content"].encode()) for s in steps)


def test_streamed_choices_are_assembled_per_index():
    from stepmill.protocols import openai_chat

    assembler = openai_chat.StreamAssembler()
    for index, text in ((0, "a"), (1, "b"), (0, "c"), (1, "d")):
        assembler.feed(None, json.dumps({"id": "x", "choices": [{"index": index, "delta": {"content": text}}]}))
    for index in (0, 1):
        assembler.feed(None, json.dumps({"id": "x", "choices": [{"index": index, "delta": {}, "finish_reason": "stop"}]}))
    assembler.feed(None, "[DONE]")
    completion = assembler.finish()
    assert completion.message["content"] == "ac"
    assert [c.message["content"] for c in completion.alternatives] == ["bd"]
