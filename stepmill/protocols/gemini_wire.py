"""What both directions of the Gemini API read of its wire form: the path (``…/models/{model}:generateContent``,
the model and whether it streams), a field in either JSON spelling, a turn's parts, and the function
declarations as chat tools. Recording a call (``gemini_generate``) and serving one through the engine's
chat (``gemini_via_chat``) share them.
"""

from __future__ import annotations

import re
from typing import Any

from stepmill.protocols.base import ProtocolError

# …/models/{model}:generateContent, under any version prefix (v1, v1beta, v1alpha) or gateway path
# (an engine's model is often an HF repo id: models/Qwen/Qwen3-8B:generateContent, or with %2F)
PATH = re.compile(r"/models/(.+?):(generateContent|streamGenerateContent)$")


def model_from_path(path: str) -> str | None:
    from urllib.parse import unquote

    found = PATH.search(path.split("?", 1)[0])
    return unquote(found.group(1)) if found else None


def streamed_path(path: str) -> bool:
    found = PATH.search(path.split("?", 1)[0])
    return bool(found) and found.group(2) == "streamGenerateContent"


def _get(value: dict, camel: str) -> Any:
    """A field in either JSON spelling: ``functionCall`` or ``function_call``."""
    if camel in value:
        return value[camel]
    return value.get(re.sub(r"(?<!^)([A-Z])", lambda m: "_" + m.group(1).lower(), camel))


def _parts(content: Any, where: str) -> list[dict]:
    if isinstance(content, dict):
        parts = content.get("parts")
    else:
        raise ProtocolError(f"{where} is not an object with 'parts'")
    if parts is None:
        return []
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise ProtocolError(f"{where}'s 'parts' is not a list of objects")
    return parts


def tools_of(body: dict) -> list | None:
    """Function declarations as chat tools (name, description, JSON-schema parameters)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        for declaration in (_get(tool, "functionDeclarations") or []) if isinstance(tool, dict) else []:
            if not isinstance(declaration, dict):
                continue
            parameters = _get(declaration, "parametersJsonSchema") or declaration.get("parameters") or \
                {"type": "object", "properties": {}}
            out.append({"type": "function", "function": {"name": declaration.get("name"),
                                                         "description": declaration.get("description") or "",
                                                         "parameters": parameters}})
    return out or None
