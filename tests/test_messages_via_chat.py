"""Messages served through chat completions: requests translate faithfully, and a chat stream cut
anywhere translates into the Messages events that assemble to the same answer as the whole body."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from stepmill.protocols import messages_via_chat as mvc
from stepmill.protocols import anthropic_messages
from stepmill.protocols.sse import SSEDecoder


def test_a_claude_code_request_becomes_the_chat_request_for_the_same_sample():
    body = {
        "model": "qwen", "max_tokens": 300, "stream": True, "temperature": 0.5, "stop_sequences": ["</x>"],
        "system": [{"type": "text", "text": "You are Claude Code."}, {"type": "text", "text": " Be brief."}],
        "tools": [{"name": "Bash", "description": "Run.", "input_schema": {"type": "object", "properties": {
            "command": {"type": "string"}}}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "ls?"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Running."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                               "input": {"command": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "a.py"}]},
                                         {"type": "text", "text": "and now?"}]},
        ],
    }
    chat = mvc.request_to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "You are Claude Code. Be brief."},
        {"role": "user", "content": "ls?"},
        {"role": "assistant", "content": "Running.", "reasoning_content": "hm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py"},
        {"role": "user", "content": "and now?"},
    ]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"][0]["function"]["parameters"]["properties"] == {"command": {"type": "string"}}
    assert (chat["return_token_ids"], chat["logprobs"], chat["stream"], chat["stop"]) == (True, True, True, ["</x>"])
    assert chat["stream_options"]["include_usage"] is True


def test_what_chat_cannot_carry_is_left_to_the_engines_messages_endpoint():
    with pytest.raises(mvc.Untranslatable):
        mvc.request_to_chat({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                             "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    with pytest.raises(mvc.Untranslatable):
        mvc.request_to_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "document"}]}]})


def test_what_the_chat_request_does_not_carry_is_noted():
    """Extended thinking and the like reach no engine's chat: the step says so; the user id is no request
    of the model's and goes unmentioned."""
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 2000}, "service_tier": "auto",
            "metadata": {"user_id": "u1"}}
    translated = mvc.translate(body, "/v1/messages")
    assert translated.notes == ["service_tier, thinking are not carried by the engine's chat completions"]
    assert "thinking" not in translated.chat and translated.path == "/v1/chat/completions"
    assert mvc.translate({k: v for k, v in body.items() if k not in ("thinking", "service_tier")},
                         "/v1/messages").notes == []


def test_a_named_tool_and_the_stop_sequence_that_ended_it():
    chat = mvc.request_to_chat({"model": "m", "messages": [], "tool_choice": {"type": "tool", "name": "Bash"}})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "Bash"}}
    answer = mvc.chat_to_message({"id": "chatcmpl-1", "choices": [{"message": {"content": "a"}, "finish_reason": "stop",
                                                                   "stop_reason": "</x>"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
                                 model="m", stop_sequences=["</x>"])
    assert (answer["stop_reason"], answer["stop_sequence"], answer["usage"]["input_tokens"]) == ("stop_sequence", "</x>", 3)
    assert mvc.error_body({"error": {"message": "too long"}})["error"]["message"] == "too long"


pieces = st.lists(st.text(min_size=1, max_size=8), max_size=4)
calls = st.lists(st.tuples(st.sampled_from(["Bash", "Read"]), st.dictionaries(st.sampled_from("abc"), st.integers(),
                                                                                  max_size=2)), max_size=2)


def _chat_stream(reasoning, text, tool_calls, finish) -> tuple[list[dict], dict]:
    """vLLM-shaped chunks (usage on each, as continuous_usage_stats asks) and the same answer whole."""
    chunks = [{"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
               "usage": {"prompt_tokens": 9, "completion_tokens": 0}}]
    for part in reasoning:
        chunks.append({"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {"reasoning_content": part}}]})
    for part in text:
        chunks.append({"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {"content": part}}]})
    for number, (name, arguments) in enumerate(tool_calls):
        encoded = json.dumps(arguments)
        chunks.append({"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": number, "id": f"call_{number}", "type": "function", "function": {"name": name, "arguments": ""}}]}}]})
        for cut in range(0, len(encoded), 5):
            chunks.append({"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": number, "function": {"arguments": encoded[cut:cut + 5]}}]}}]})
    chunks.append({"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                   "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
    message = {"content": "".join(text) or None, "reasoning_content": "".join(reasoning) or None,
               "tool_calls": [{"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(a)}}
                              for n, (name, a) in enumerate(tool_calls)] or None}
    whole = {"id": "chatcmpl-7", "choices": [{"index": 0, "message": message, "finish_reason": finish}],
             "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    return chunks, whole


@settings(max_examples=150, deadline=None)
@given(pieces, pieces, calls, st.data())
def test_a_stream_cut_anywhere_translates_to_the_whole_answer(reasoning, text, tool_calls, data):
    finish = "tool_calls" if tool_calls else data.draw(st.sampled_from(["stop", "length"]))
    chunks, whole = _chat_stream(reasoning, text, tool_calls, finish)
    wire = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(wire)), max_size=8))))
    translator, decoder, out = mvc.StreamTranslator(model="claude-x"), SSEDecoder(), b""
    for start, end in zip([0, *cuts], [*cuts, len(wire)]):
        out += b"".join(translator(event) for event in decoder.push(wire[start:end]))
    out += b"".join(translator(event) for event in decoder.flush()) + translator.close()
    assembler = anthropic_messages.StreamAssembler()
    events = SSEDecoder().push(out)
    assert [e.event for e in events][:1] == ["message_start"] and events[-1].event == "message_stop"
    for event in events:
        assembler.feed(event.event, event.data)
    streamed = assembler.finish()
    plain = anthropic_messages.parse_response(mvc.chat_to_message(whole, model="claude-x"))
    assert streamed.message == plain.message
    assert streamed.finish_reason == plain.finish_reason == {"stop": "end_turn", "length": "max_tokens",
                                                              "tool_calls": "tool_use"}[finish]
    assert streamed.usage["output_tokens"] == plain.usage["output_tokens"] == 4


def test_a_tool_result_with_an_image_is_not_cut_down_to_its_text():
    with pytest.raises(mvc.Untranslatable, match="tool result with images"):
        mvc.request_to_chat({"model": "m", "messages": [{"role": "user", "content": [{
            "type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "see"}, {"type": "image", "source": {"type": "base64", "data": "AA"}}]}]}]})
