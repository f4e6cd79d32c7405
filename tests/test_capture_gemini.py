"""Google's Gemini API through the proxy with the real google-genai SDK (what Gemini CLI is built on):
plain and streamed calls, a tool turn linked to the next, thoughts kept as reasoning, both stream forms
(``?alt=sse`` and the JSON array) assembled to the same step, and a stream cut anywhere never lost."""

import base64
import json

import httpx2 as httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmill.protocols import gemini_generate, match
from stepmill.protocols.streams import assemble
from stepmill.store.encoding import loads

from .upstream import gemini_chunks

HOST = "https://generativelanguage.googleapis.com"
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "OBJECT", "properties": {"city": {"type": "STRING"}}}}


@pytest.fixture
def gemini(proxy):
    from google import genai
    from google.genai import types

    return genai.Client(api_key="AIza-test-secret", http_options=types.HttpOptions(base_url=HOST, timeout=30_000))


def test_the_paths_of_the_api_are_recognised():
    for path in ("/v1beta/models/gemini-2.5-pro:generateContent", "/v1/models/m:streamGenerateContent?alt=sse",
                 "/gateway/v1beta/models/gemini-2.5-flash:streamGenerateContent"):
        assert match(path) is gemini_generate.PROTOCOL
    assert match("/v1beta/models/gemini-2.5-pro:countTokens") is None
    assert match("/v1beta/models/gemini-2.5-pro") is None


def test_plain_call(proxy, gemini, marker):
    from google.genai import types

    reply = gemini.models.generate_content(model="gemini-2.5-flash", contents=f"hi {marker}",
                                           config=types.GenerateContentConfig(system_instruction="Be kind."))
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["api"] == "gemini.generate" and step["host"] == "generativelanguage.googleapis.com"
    assert step["model"] == "gemini-2.5-flash" and step["transport"] == "http" and step["status"] == "ok"
    assert step["messages"] == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": f"hi {marker}"}]
    assert step["completion"] == {"role": "assistant", "content": reply.text}
    assert step["finish_reason"] == "STOP" and step["usage"]["input_tokens"] == 30
    assert "AIza-test-secret" not in json.dumps(proxy.store().query("SELECT * FROM steps WHERE id = ?",
                                                                    [step["step_id"]]), default=str)


def test_streamed_tool_loop_with_thoughts(proxy, gemini, marker):
    from google.genai import types

    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(**WEATHER)])],
        thinking_config=types.ThinkingConfig(include_thoughts=True),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    contents = [types.Content(role="user", parts=[types.Part(text=f"weather? {marker}")])]
    chunks = list(gemini.models.generate_content_stream(model="gemini-2.5-pro", contents=contents, config=config))
    parts = [p for c in chunks for p in c.candidates[0].content.parts]
    call = next(p.function_call for p in parts if p.function_call)
    assert call.name == "get_weather" and call.args == {"city": "Paris", "days": 2}
    contents.append(types.Content(role="model", parts=parts))
    contents.append(types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
        name="get_weather", response={"output": "rainy"}))]))
    second = list(gemini.models.generate_content_stream(model="gemini-2.5-pro", contents=contents, config=config))
    assert "rainy" in "".join(c.text or "" for c in second)

    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    one, two = proxy.trajectory_steps(root["trajectory_id"], 2)
    assert one["transport"] == "sse" and one["status"] == "ok" and one["model"] == "gemini-2.5-pro"
    completion = one["completion"]
    assert completion["reasoning_content"] == "Let me look at the weather tool."
    assert completion["content"] == "Checking."
    assert completion["tool_calls"] == [{"id": None, "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]
    assert one["finish_reason"] == "STOP"
    # the wire form keeps what canonical messages cannot: the function call's thoughtSignature
    store = proxy.store()
    wire = loads(store.query("SELECT wire_completion FROM steps WHERE id = ?", [one["step_id"]])[0]["wire_completion"])
    assert wire[0]["role"] == "model" and base64.b64decode(wire[0]["parts"][-1]["thoughtSignature"]).startswith(b"sig-")
    assert two["parent_step_id"] == one["step_id"] and two["step_index"] == 1
    assert two["messages"][-1] == {"role": "tool", "tool_call_id": None, "name": "get_weather",
                                   "content": json.dumps({"output": "rainy"})}


def test_a_json_array_stream_is_passed_on_as_it_comes_and_recorded_as_the_sse_one(proxy, marker):
    """Without ?alt=sse the API streams one JSON array; the agent gets it element by element, and the
    step is the one the SSE form gives."""
    body = {"contents": [{"role": "user", "parts": [{"text": f"hello there {marker}"}]}]}
    url = f"{HOST}/v1beta/models/gemini-2.5-flash:streamGenerateContent"
    with httpx.Client(timeout=30) as client:  # through HTTPS_PROXY, trusting SSL_CERT_FILE (the proxy fixture sets both)
        with client.stream("POST", url, json=body, headers={"x-goog-api-key": "AIza-test-secret"}) as response:
            pieces = list(response.iter_raw())
        sse = client.post(url + "?alt=sse", json=body, headers={"x-goog-api-key": "AIza-test-secret"})
    assert len(pieces) > 1 and json.loads(b"".join(pieces))[-1]["candidates"][0]["finishReason"] == "STOP"
    assert sse.headers["content-type"].startswith("text/event-stream")
    array, events = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"], count=2)
    for step in (array, events):
        assert step["status"] == "ok" and step["completion"]["content"] == f"Echo: hello there {marker}"
        assert step["model"] == "gemini-2.5-flash" and step["finish_reason"] == "STOP"
    assert array["usage"] == events["usage"]


def test_an_upstream_error_is_an_error_step(proxy, gemini, marker):
    from google.genai import errors

    with pytest.raises(errors.ServerError):
        gemini.models.generate_content(model="http-500", contents=f"boom {marker}")
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "error" and "upstream exploded" in step["error"]


# -- the stream assembler, off the proxy -----------------------------------------------------------------
def _streams(chunks: list[dict]) -> dict[str, bytes]:
    sse = b"".join(b"data: " + json.dumps(c).encode() + b"\r\n\r\n" for c in chunks)
    array = b"[" + b"\n,\r\n".join(json.dumps(c, indent=2).encode() for c in chunks) + b"\n]"
    return {"sse": sse, "array": array}


def _assembled(raw: bytes, cuts: list[int]):
    marks = [(end, float(i)) for i, end in enumerate(sorted(set(cuts + [len(raw)]))) if end]
    return assemble(gemini_generate.StreamAssembler(), raw, marks, None, gemini_generate.PROTOCOL.split)


REQUESTS = [{"contents": [{"role": "user", "parts": [{"text": "weather in Paris?"}]}], "tools": [{}]},
            {"contents": [{"role": "user", "parts": [{"text": "no tools: say hello"}]}],
             "generationConfig": {"thinkingConfig": {"includeThoughts": True}}},
            {"contents": [{"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {"x": 1}}}]}]}]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(REQUESTS), st.sampled_from(["sse", "array"]), st.lists(st.integers(0, 4000), max_size=8),
       st.floats(0, 1))
def test_a_stream_assembles_to_the_whole_answer_and_a_cut_one_to_its_beginning(request, form, cuts, where):
    chunks = gemini_chunks(request, "gemini-2.5-pro")
    whole = gemini_generate.parse_response(chunks)  # what the plain call gives (the array, element by element)
    raw = _streams(chunks)[form]
    result = _assembled(raw, [c % (len(raw) + 1) for c in cuts])
    assert result.terminal and result.completion.status == "ok"
    assert result.completion.message == whole.message and result.completion.usage == whole.usage
    assert result.completion.wire == whole.wire
    cut = raw[:int(len(raw) * where)]
    partial = _assembled(cut, [c % (len(cut) + 1) for c in cuts]).completion  # never raises
    if partial.status == "ok":
        assert partial.message == whole.message
    else:
        assert partial.status in ("incomplete", "error")
        text = partial.message["content"] if partial.message else ""
        assert whole.message["content"].startswith(text)


def test_a_blocked_prompt_and_bad_bodies_are_clear_errors():
    blocked = gemini_generate.parse_response({"promptFeedback": {"blockReason": "SAFETY"}})
    assert blocked.status == "error" and "SAFETY" in blocked.error
    with pytest.raises(gemini_generate.ProtocolError, match="contents"):
        gemini_generate.parse_request({"messages": []})
    with pytest.raises(gemini_generate.ProtocolError, match="parts"):
        gemini_generate.parse_request({"contents": [{"role": "user", "parts": "text"}]})
    failed = gemini_generate.parse_response({"error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED"}})
    assert failed.status == "error" and "RESOURCE_EXHAUSTED" in failed.error


# -- on a self-hosted engine: served through its chat completions, exact ids ----------------------------
@pytest.mark.parametrize("form", ["whole", "sse", "array"])
def test_gemini_on_an_engine_is_served_through_its_chat_with_exact_ids(proxy, simulated_llm, marker, form):
    """What Gemini CLI on vLLM needs: the engine has no Gemini endpoint, so the proxy sends each call to its
    chat completions (asking for ids) and the agent gets Gemini's answer back; the tool turn links."""
    import ssl

    from google import genai
    from google.genai import types

    verify = ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"])
    client = genai.Client(api_key="AIza-local", http_options=types.HttpOptions(
        base_url=simulated_llm.url.removesuffix("/v1"), timeout=30_000,
        client_args={"proxy": proxy.url, "verify": verify, "trust_env": False}))
    bash = types.FunctionDeclaration(name="Bash", description="Run a shell command.", parameters_json_schema={
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]})
    config = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[bash])],
                                         automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    contents = [types.Content(role="user", parts=[types.Part(text=f"[{marker}] What is 12 * 12?")])]

    def call(contents):
        if form == "whole":
            return client.models.generate_content(model="gemini-sim", contents=contents, config=config)
        if form == "sse":
            chunks = list(client.models.generate_content_stream(model="gemini-sim", contents=contents, config=config))
            parts = [p for c in chunks for p in (c.candidates[0].content.parts or [])]
            assert chunks[-1].candidates[0].finish_reason == "STOP"
            return types.GenerateContentResponse(candidates=[types.Candidate(
                content=types.Content(role="model", parts=parts), finish_reason="STOP")])
        body = {"contents": [c.model_dump(mode="json", exclude_none=True) for c in contents],
                "tools": [{"functionDeclarations": [bash.model_dump(mode="json", by_alias=True, exclude_none=True)]}]}
        import httpx2

        with httpx2.Client(proxy=proxy.url, verify=verify, timeout=30, trust_env=False) as http:
            answer = http.post(f"{simulated_llm.url.removesuffix('/v1')}/v1beta/models/gemini-sim:streamGenerateContent",
                               json=body)
        array = answer.json()
        assert isinstance(array, list) and array[-1]["candidates"][0]["finishReason"] == "STOP"
        return types.GenerateContentResponse.model_validate(array[-1])

    for attempt in range(1, 13):  # the coin picks the tool or a direct answer: go on until it calls the tool
        reply = call(contents)
        parts = reply.candidates[0].content.parts
        calls = [p.function_call for p in parts if p.function_call]
        if calls:
            assert calls[0].name == "Bash" and calls[0].args == {"command": "python3 -c 'print(12 * 12)'"}
            break
        assert "\\boxed{" in "".join(p.text or "" for p in parts)
    else:
        pytest.fail("the engine never called the tool")
    # recorded before the next turn is sent: a turn journaled before the one it continues is not linked to it
    # (the client may send it while the upstream is still closing the last stream); see the README
    proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"], count=attempt, timeout=60)
    contents += [types.Content(role="model", parts=parts), types.Content(role="user", parts=[types.Part(
        function_response=types.FunctionResponse(name="Bash", response={"output": "144"}))])]
    call(contents)
    # the tool turn continues the call that asked for it
    [after] = proxy.steps("s.messages_suffix LIKE ? AND s.parent_step_id IN "
                          "(SELECT id FROM steps WHERE messages_suffix LIKE ?)", ["%144%", f"%{marker}%"], timeout=60)
    steps = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"], timeout=60) + [after]
    # the agent's protocol, and the engine's chat completions whose exchange the step keeps
    assert {(s["api"], s["engine_api"]) for s in steps} == {("gemini.generate", "openai.chat")}
    assert {s["status"] for s in steps} == {"ok"}
    assert {s["token_provenance"] for s in steps} == {"exact"}  # the ids the engine sampled, every step
    assert after["parent_step_id"] and after["messages"][-1]["role"] == "tool"


def test_an_error_answer_to_a_json_array_stream_keeps_its_message(proxy, marker):
    """A streamed call answered with an error object (4xx/5xx) is an error step that says why, not a stream
    cut short."""
    body = {"contents": [{"role": "user", "parts": [{"text": f"boom {marker}"}]}]}
    with httpx.Client(timeout=30) as client:
        answer = client.post(f"{HOST}/v1beta/models/http-500:streamGenerateContent", json=body)
    assert answer.status_code == 500
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "error" and "upstream exploded" in step["error"] and step["transport"] == "http"


def test_paths_with_a_repo_id_or_a_second_version_prefix():
    from stepmill.protocols import gemini_via_chat

    assert gemini_generate.model_from_path("/v1beta/models/Qwen/Qwen3-8B:generateContent") == "Qwen/Qwen3-8B"
    assert gemini_generate.model_from_path("/v1beta/models/Qwen%2FQwen3-8B:streamGenerateContent") == "Qwen/Qwen3-8B"
    assert match("/v1beta/models/Qwen/Qwen3-8B:streamGenerateContent?alt=sse").api == gemini_generate.API
    for path, chat in [("/v1beta/models/m:generateContent", "/v1/chat/completions"),
                       ("/v1/v1beta/models/m:streamGenerateContent?alt=sse", "/v1/chat/completions"),
                       ("/llm/v1beta/models/a/b:generateContent", "/llm/v1/chat/completions")]:
        assert gemini_via_chat.chat_path(path) == chat


def test_a_call_cut_by_the_token_limit_is_not_handed_to_the_agent_to_run():
    from stepmill.protocols import gemini_via_chat
    from stepmill.protocols.sse import Event

    cut = {"id": "c", "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "x",
           "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}]}}]}
    assert [p for p in gemini_via_chat.answer_of(cut, model="m")["candidates"][0]["content"]["parts"]] == [{"text": "x"}]
    whole = {**cut, "choices": [{**cut["choices"][0], "finish_reason": "tool_calls", "message": {
        **cut["choices"][0]["message"], "tool_calls": [{"id": "t", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}]}
    assert gemini_via_chat.answer_of(whole, model="m")["candidates"][0]["content"]["parts"][-1] == {
        "functionCall": {"id": "t", "name": "f", "args": {"a": 1}}}
    stream = gemini_via_chat.StreamTranslator(model="m")
    stream(Event(None, json.dumps({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "t", "function": {"name": "f", "arguments": '{"a": '}}]}, "finish_reason": "length"}]}), b""))
    last = json.loads(stream(Event(None, "[DONE]", b"")).decode()[6:])
    assert last["candidates"][0]["finishReason"] == "MAX_TOKENS" and last["candidates"][0]["content"]["parts"] == []


# -- what the translation to chat carries, and says it does not ----------------------------------------------
def _translated(body: dict, path: str = "/v1beta/models/m:generateContent"):
    from stepmill.protocols import gemini_via_chat

    notes: list[str] = []
    return gemini_via_chat.request_to_chat(body, path, notes=notes), notes


USER = [{"role": "user", "parts": [{"text": "hi"}]}]


def test_json_mode_becomes_a_response_format():
    schema = {"type": "OBJECT", "properties": {"city": {"type": "STRING"}, "days": {"type": "ARRAY", "items": {
        "type": "INTEGER"}}}, "required": ["city"]}
    chat, notes = _translated({"contents": USER, "generationConfig": {
        "responseMimeType": "application/json", "responseSchema": schema}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "response", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {
            "type": "integer"}}}, "required": ["city"]}}} and notes == []
    plain = {"type": "object", "properties": {"a": {"type": ["string", "null"]}}}  # JSON Schema, as it is
    chat, notes = _translated({"contents": USER, "generation_config": {
        "response_mime_type": "application/json", "response_json_schema": plain}})
    assert chat["response_format"]["json_schema"]["schema"] == plain and notes == []
    chat, notes = _translated({"contents": USER, "generationConfig": {"responseMimeType": "application/json"}})
    assert chat["response_format"] == {"type": "json_object"} and notes == []
    chat, notes = _translated({"contents": USER, "generationConfig": {"responseMimeType": "text/x.enum",
                                                                      "responseSchema": {"type": "STRING"}}})
    assert "response_format" not in chat and notes == [
        "generationConfig.responseMimeType 'text/x.enum' is not carried by the engine's chat completions"]
    chat, notes = _translated({"contents": USER, "generationConfig": {"responseSchema": {"type": "STRING"}}})
    assert "response_format" not in chat and notes == [
        "generationConfig a response schema without JSON mode is not carried by the engine's chat completions"]


def test_function_calling_modes_become_a_tool_choice():
    tools = [{"functionDeclarations": [{"name": "a"}, {"name": "b"}]}]
    for mode, expected in [("AUTO", "auto"), ("ANY", "required"), ("NONE", "none"), ("any", "required")]:
        chat, notes = _translated({"contents": USER, "tools": tools,
                                   "toolConfig": {"functionCallingConfig": {"mode": mode}}})
        assert chat["tool_choice"] == expected and notes == [], mode
    chat, notes = _translated({"contents": USER, "tools": tools, "tool_config": {"function_calling_config": {
        "mode": "ANY", "allowed_function_names": ["b"]}}})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "b"}} and notes == []
    chat, notes = _translated({"contents": USER, "tools": tools, "toolConfig": {"functionCallingConfig": {
        "mode": "ANY", "allowedFunctionNames": ["a", "b"]}}})
    assert chat["tool_choice"] == "required" and notes == [
        "toolConfig's allowedFunctionNames (mode ANY) ['a', 'b'] is not carried by the engine's chat completions: any "
        "declared function may be called"]
    chat, notes = _translated({"contents": USER, "tools": tools, "toolConfig": {"functionCallingConfig": {
        "mode": "VALIDATED"}, "retrievalConfig": {"latLng": {}}}})
    assert chat["tool_choice"] == "auto" and notes == [
        "toolConfig retrievalConfig is not carried by the engine's chat completions",
        "toolConfig's function calling mode VALIDATED is not carried by the engine's chat completions (sent as auto)"]


def test_what_chat_cannot_carry_is_noted_and_what_it_can_is_sent():
    chat, notes = _translated({
        "contents": USER, "cachedContent": "cachedContents/x", "safetySettings": [{"category": "X"}],
        "labels": {"session_id": "s"},
        "tools": [{"functionDeclarations": [{"name": "a"}]}, {"googleSearch": {}}],
        "generationConfig": {"temperature": 0.5, "presencePenalty": 0.1, "frequency_penalty": 0.2,
                             "responseLogprobs": True, "logprobs": 3, "responseModalities": ["TEXT"],
                             "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 1024}}})
    assert (chat["temperature"], chat["presence_penalty"], chat["frequency_penalty"]) == (0.5, 0.1, 0.2)
    assert [t["function"]["name"] for t in chat["tools"]] == ["a"]
    assert notes == [
        "generationConfig.thinkingConfig {\"thinkingBudget\": 1024} is not carried by the engine's chat completions",
        "generationConfig logprobs, responseLogprobs are not carried by the engine's chat completions",
        "tools googleSearch is not carried by the engine's chat completions (function declarations are)",
        "cachedContent, safetySettings are not carried by the engine's chat completions"]
    # what Gemini CLI sends every turn carries whole: no note
    chat, notes = _translated({"contents": USER, "generationConfig": {
        "temperature": 0, "topP": 1, "thinkingConfig": {"includeThoughts": True, "thinkingBudget": -1}}})
    assert notes == [] and (chat["temperature"], chat["top_p"]) == (0, 1)


def test_a_translated_call_carries_its_notes():
    from stepmill.protocols import gemini_via_chat

    translated = gemini_via_chat.translate({"contents": USER, "safetySettings": []},
                                           "/v1beta/models/m:streamGenerateContent", "vllm")
    assert translated.path == "/v1/chat/completions" and translated.options == {"model": "m", "array": True}
    assert translated.notes == ["safetySettings is not carried by the engine's chat completions"]


def test_on_an_engine_what_the_chat_request_does_not_carry_is_on_the_step(proxy, simulated_llm, marker):
    import ssl

    verify = ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"])
    body = {"contents": [{"role": "user", "parts": [{"text": f"[{marker}] What is 2 + 2?"}]}],
            "tools": [{"functionDeclarations": [{"name": "Bash", "parameters": {"type": "OBJECT"}}]}],
            "toolConfig": {"functionCallingConfig": {"mode": "NONE"}},
            "safetySettings": [{"category": "HARM_CATEGORY_HATE_SPEECH", "threshold": "BLOCK_NONE"}]}
    with httpx.Client(proxy=proxy.url, verify=verify, timeout=30, trust_env=False) as http:
        answer = http.post(f"{simulated_llm.url.removesuffix('/v1')}/v1beta/models/gemini-sim:generateContent",
                           json=body)
    assert answer.status_code == 200 and answer.json()["candidates"][0]["finishReason"] == "STOP"
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert (step["api"], step["engine_api"], step["token_provenance"]) == ("gemini.generate", "openai.chat", "exact")
    assert step["params"]["tool_choice"] == "none"  # the chat request the engine got
    assert "safetySettings is not carried by the engine's chat completions" in step["metadata"]["notes"]
