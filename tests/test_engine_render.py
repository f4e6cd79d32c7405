"""A Messages call an engine answers without ids (stepmill_messages_via_chat off): the step gets ids
rendered by the engine's own chat template through its /tokenize, and says so."""

import anthropic
import pytest

from .conftest import launch_proxy, stop_proxy


@pytest.fixture
def messages_proxy(tmp_path, simulated_llm):
    started = launch_proxy(tmp_path / "p", simulated_llm.url.removesuffix("/v1"),
                           "--set", "stepmill_messages_via_chat=false", "--set", "termlog_verbosity=warn")
    yield started
    stop_proxy(started)


def test_an_engines_messages_answer_is_rendered_by_its_own_template(messages_proxy, simulated_llm, marker):
    from stepmill.simulated_llm import SimulatedModel, SimulatedPolicy

    client = anthropic.Anthropic(api_key="sk-ant-x", base_url=f"http://127.0.0.1:{messages_proxy.reverse_port}",
                                 max_retries=0)
    question = f"[{marker}] What is 6 * 7?"
    message = client.messages.create(model="qwen-sim", max_tokens=128, messages=[{"role": "user", "content": question}])
    [step] = messages_proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["api"] == "anthropic.messages" and step["token_provenance"] == "rendered", step
    assert any("rendered by the engine's own chat template" in n for n in step["metadata"]["notes"])
    engine = SimulatedModel(str(simulated_llm.tokenizer), SimulatedPolicy())
    chat = [{"role": "user", "content": question}]
    assert step["prompt_ids"] == engine.encode(engine.render(chat, []))
    reply = engine.encode(engine.render(chat + [{"role": "assistant", "content": message.content[0].text}], [],
                                        generation_prompt=False))
    assert step["prompt_ids"] + step["response_ids"] == reply[:len(step["prompt_ids"]) + len(step["response_ids"])]
    assert engine.tokenizer.decode(step["response_ids"][-1:]) == "<|im_end|>"  # the template's newline dropped
