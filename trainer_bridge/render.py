"""Rendering canonical steps to token ids with a chat template, and checking what that loses.

A rendered step is split into prompt ids (ending with the generation prompt) and response
ids (the assistant turn up to and including its end-of-turn token). Every place where the
template does not reproduce itself is reported with a token position, never smoothed over.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

from stepmill.errors import ConfigError

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass
class Rendered:
    prompt_ids: list[int]
    response_ids: list[int]
    fidelity: str = "ok"  # ok | divergent
    details: list[str] = field(default_factory=list)
    spliced_len: int | None = None


def load_tokenizer(path_or_name: str):
    """A transformers tokenizer from a local path or the local Hugging Face cache; never downloads."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path_or_name, local_files_only=True)
    except (OSError, ValueError) as exc:  # nothing there (OSError), a folder without a usable one (ValueError)
        raise ConfigError(f"no tokenizer at {path_or_name!r} (a local folder or a model already in the "
                         f"Hugging Face cache; stepmill never downloads): {exc}") from None


def template_tools(api: str, tools: list | None) -> list | None:
    """Tools in the OpenAI function shape chat templates expect, whatever API they came from."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "function" and "function" in tool:
            out.append(tool)
        elif "input_schema" in tool:  # Anthropic
            out.append({"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description", ""),
                                                          "parameters": tool.get("input_schema") or {}}})
        elif tool.get("type") == "function":  # Responses
            out.append({"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description", ""),
                                                          "parameters": tool.get("parameters") or {}}})
    return out or None


def template_messages(messages: list[dict]) -> list[dict]:
    """Canonical messages as templates take them: tool call arguments as objects, not JSON strings."""
    out = copy.deepcopy(messages)
    for message in out:
        for call in message.get("tool_calls") or []:
            fn = call.get("function") or {}
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                except ValueError:
                    pass  # left as text; the template renders what it can
    return out


def end_of_turn_ids(tokenizer) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN_TOKENS:
        if token in vocab:
            ids.add(vocab[token])
    return ids


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Renderer:
    def __init__(self, tokenizer, name: str | None = None):
        self.tokenizer = tokenizer
        self.name = name or getattr(tokenizer, "name_or_path", None)
        self.end_ids = end_of_turn_ids(tokenizer)

    def text(self, messages: list[dict], tools: list | None, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(template_messages(messages), tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _trim(self, response: list[int]) -> tuple[list[int], list[int]]:
        """Split the rendered assistant turn at its last end-of-turn token: (response, template tail)."""
        for i in range(len(response) - 1, -1, -1):
            if response[i] in self.end_ids:
                return response[: i + 1], response[i + 1:]
        return response, []

    def render(self, messages: list[dict], completion: dict, tools: list | None) -> Rendered:
        prompt_text = self.text(messages, tools, generation_prompt=True)
        full_text = self.text(messages + [completion], tools, generation_prompt=False)
        prompt_ids = self.encode(prompt_text)
        full_ids = self.encode(full_text)
        details = []
        if not full_text.startswith(prompt_text):
            k = next((i for i, (x, y) in enumerate(zip(prompt_text, full_text)) if x != y), len(prompt_text))
            details.append(f"the template renders the prompt differently once the completion follows "
                           f"(character {k}: {prompt_text[k:k + 30]!r} vs {full_text[k:k + 30]!r})")
        k = first_difference(full_ids[: len(prompt_ids)], prompt_ids)
        if k is not None:
            details.append(f"prompt ids are not a prefix of the full rendering at token {k}")
        response, _tail = self._trim(full_ids[len(prompt_ids):])
        # Re-rendering the completion on its own must give the same ids (no merges across the boundary).
        response_text = self.tokenizer.decode(response, skip_special_tokens=False)
        again = self.encode(response_text)
        k = first_difference(again, response)
        if k is not None:
            details.append(f"the completion re-encodes differently at response token {k} "
                           f"({response[k] if k < len(response) else None} vs {again[k] if k < len(again) else None})")
        return Rendered(prompt_ids, response, "divergent" if details else "ok", details)

    def splice(self, messages: list[dict], completion: dict, tools: list | None, parent_ids: list[int],
                parent_message_count: int) -> Rendered:
        """Keep the parent's exact prompt+response ids; render only the messages after them."""
        rendered = self.render(messages, completion, tools)
        before = self.text(messages[:parent_message_count], tools, generation_prompt=False)
        after = self.text(messages, tools, generation_prompt=True)
        if after.startswith(before):
            delta = after[len(before):]
        else:
            # The template rewrites earlier turns (e.g. drops old thinking): render the new messages
            # after a neutral stand-in history instead, so only their own text is added.
            stand_in = [m for m in messages[:1] if m.get("role") == "system"] + [
                {"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
            base = self.text(stand_in, tools, generation_prompt=False)
            full = self.text(stand_in + messages[parent_message_count:], tools, generation_prompt=True)
            if not full.startswith(base):
                rendered.details.append("splice impossible: the template does not render new messages as a suffix")
                rendered.fidelity = "divergent"
                return rendered
            delta = full[len(base):]
            rendered.details.append("the template rewrites earlier turns; new messages rendered after a stand-in")
        # The parent's response ends at its end-of-turn token; the template's text after it
        # (a newline for ChatML) belongs to the next prompt.
        tail = ""
        for token in END_OF_TURN_TOKENS:
            if token in before:
                tail = before[before.rindex(token) + len(token):]
                break
        rendered.prompt_ids = list(parent_ids) + self.encode(tail + delta)
        rendered.spliced_len = len(parent_ids)
        return rendered
