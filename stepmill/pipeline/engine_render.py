"""Off the event loop, in the writer (before its transaction): rendered ids for a Messages call a vLLM engine answered without ids.

When stepmill does not serve an agent's Messages call through the engine's chat completions
(``stepmill_messages_via_chat`` off, or a request chat cannot carry), the engine's ``/v1/messages``
gives no token ids. The engine can still render the exchange with its own chat template: its
``POST /tokenize`` takes the conversation (as its chat endpoint would receive it) and answers the
ids. The step's ids are then ``rendered``, and say so: the reply as the template writes it, not
the tokens the engine sampled. Runs in the writer, before the transaction, bounded by a timeout.
"""

from __future__ import annotations

import json
import urllib.request

from stepmill.protocols import messages_via_chat

TIMEOUT = 10.0


def _tokenize(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the engine, directly
    with opener.open(request, timeout=TIMEOUT) as response:
        return json.loads(response.read())


BYTE_LEVEL_BLANKS = set("ĠĊĉč")  # space, newline, tab, return as byte-level BPE vocabularies spell them


def _blank(token: str) -> bool:
    """A token string (``convert_ids_to_tokens``, as vLLM answers it) that is only whitespace."""
    return not token.strip() or set(token) <= BYTE_LEVEL_BLANKS | {" ", "\n", "\t"}


def render(base: str, body: dict, wire_completion: list) -> tuple[list[int], list[int], str]:
    """(prompt ids, response ids, note) from the engine at ``base``, for a Messages exchange (``body``: its
    request as the writer parsed it; ``wire_completion``: the answer as the protocol carries it, one
    assistant message); ValueError or OSError when it cannot."""
    chat = messages_via_chat.request_to_chat(body)
    reply = messages_via_chat.messages_of({"messages": wire_completion})
    common = {"model": body.get("model"), **({"tools": chat["tools"]} if chat.get("tools") else {})}
    url = base.rstrip("/") + "/tokenize"
    prompt = _tokenize(url, {**common, "messages": chat["messages"], "add_generation_prompt": True})["tokens"]
    whole = _tokenize(url, {**common, "messages": chat["messages"] + reply, "add_generation_prompt": False,
                            "return_token_strs": True})
    tokens, strings = whole["tokens"], whole.get("token_strs") or []
    note = (f"ids rendered by the engine's own chat template ({url}): the reply as the template writes it, not "
            "the tokens the engine sampled")
    if tokens[:len(prompt)] != prompt:
        # The reply's first characters merge with the prompt's last token once rendered together: the
        # reply is encoded on its own, after the prompt the template gives.
        text = "".join(m.get("content") or "" for m in reply if isinstance(m.get("content"), str))
        alone = _tokenize(url, {"model": body.get("model"), "prompt": text, "add_special_tokens": False})["tokens"]
        return prompt, alone, note + "; the reply encoded on its own (rendered with the prompt, it merges into it)"
    response = tokens[len(prompt):]
    tail = strings[len(prompt):]
    while response and len(tail) == len(response) and _blank(tail[-1]):
        response, tail = response[:-1], tail[:-1]  # the template's whitespace after the turn: never sampled
    return prompt, response, note
