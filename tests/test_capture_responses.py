"""OpenAI Responses through the proxy: HTTP, SSE and the WebSocket transport Codex uses."""


TOOL = {"type": "function", "name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_plain_and_chained_by_previous_response_id(proxy, openai_client, marker):
    first = openai_client.responses.create(model="gpt-5-test", instructions="Be terse.",
                                           input=f"weather? {marker}", tools=[TOOL])
    call = next(i for i in first.output if i.type == "function_call")
    second = openai_client.responses.create(
        model="gpt-5-test", instructions="Be terse.", previous_response_id=first.id, tools=[TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == "The tool said: sunny"
    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    one, two = proxy.trajectory_steps(root["trajectory_id"], 2)
    assert one["api"] == "openai.responses" and one["response_id"] == first.id
    assert two["parent_step_id"] == one["step_id"]
    # The second request carried only the tool output; the step holds the whole conversation.
    assert two["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": f"weather? {marker}"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    assert two["completion"] == {"role": "assistant", "content": "The tool said: sunny"}
    assert one["finish_reason"] == "tool_calls" and two["finish_reason"] == "stop"
    assert two["usage"]["cache_read_tokens"] == 10


def test_streamed_with_reasoning_and_full_resend(proxy, openai_client, marker):
    """Codex with store=false re-sends the whole input, reasoning items included."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": f"weather? {marker}"}]}]
    kwargs = dict(model="gpt-5-test", tools=[TOOL], store=False, reasoning={"effort": "low"},
                  include=["reasoning.encrypted_content"])
    with openai_client.responses.stream(input=items, **kwargs) as stream:
        first = stream.get_final_response()
    items += [o.model_dump(exclude_none=True) for o in first.output]
    call = next(i for i in first.output if i.type == "function_call")
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "cloudy"})
    with openai_client.responses.stream(input=items, **kwargs) as stream:
        second = stream.get_final_response()
    assert second.output_text == "The tool said: cloudy"
    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    one, two = proxy.trajectory_steps(root["trajectory_id"], 2)
    assert one["transport"] == "sse" and one["status"] == "ok"
    assert one["completion"]["reasoning_content"] == "Thinking about it."
    assert two["parent_step_id"] == one["step_id"]
    store = proxy.store()
    wire = store.wire_messages(two["step_id"])
    assert any(i.get("encrypted_content") == "gAAAA-opaque" for i in wire)


def test_websocket_chain_with_warmup(proxy, openai_client, marker):
    with openai_client.responses.connect() as connection:
        def turn(**kwargs):
            connection.response.create(model="gpt-5-codex-test", tools=[TOOL], store=False, **kwargs)
            for event in connection:
                if event.type in ("response.completed", "response.failed", "response.incomplete", "error"):
                    return event
        warm = turn(instructions="You are Codex.", input=[{"role": "user", "content": f"fix the bug {marker}"}],
                    generate=False)
        first = turn(instructions="You are Codex.", input=[], previous_response_id=warm.response.id)
        call = next(i for i in first.response.output if i.type == "function_call")
        second = turn(instructions="You are Codex.", previous_response_id=first.response.id,
                      input=[{"type": "function_call_output", "call_id": call.call_id, "output": "patched"}])
    assert second.response.output[0].content[0].text == "The tool said: patched"
    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    steps = proxy.trajectory_steps(root["trajectory_id"], 2)
    assert len(steps) == 2, "the warm-up is not a step"
    one, two = steps
    assert one["transport"] == two["transport"] == "websocket"
    assert one["messages"] == [{"role": "system", "content": "You are Codex."},
                               {"role": "user", "content": f"fix the bug {marker}"}]
    assert two["parent_step_id"] == one["step_id"]
    assert two["messages"][2]["tool_calls"][0]["id"] == call.call_id
    assert two["messages"][3] == {"role": "tool", "tool_call_id": call.call_id, "content": "patched"}
    assert two["completion"]["content"] == "The tool said: patched"
    assert one["ttft_ms"] is not None and one["status"] == "ok"


def test_codex_session_header_names_the_trajectory(proxy, openai_client, marker):
    with openai_client.responses.connect(extra_headers={"session_id": f"codex-{marker}"}) as connection:
        connection.response.create(model="gpt-5-codex-test", input=f"hello {marker}")
        for event in connection:
            if event.type == "response.completed":
                break
    [step] = proxy.trajectory_steps(f"codex-{marker}", 1)
    assert step["transport"] == "websocket" and step["completion"]["content"] == f"Echo: hello {marker}"
