"""Reward functions shipped with stepmill, for `stepmill score` (see store/scoring.py).

Each takes the trajectory (``messages``, ``completion``, ``metadata``, ``steps``) and options from
the configuration, and returns a score, or (score, details).
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from fractions import Fraction

from stepmill.protocols.messages import content_text

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _final_text(trajectory: dict) -> str:
    return content_text((trajectory.get("completion") or {}).get("content"))


def normalise_answer(text: str) -> str:
    """A canonical form for comparing answers: numbers as exact fractions ('$1,234.50', '1234.5' and
    '2469/2' are one answer; '\\frac{1}{2}', '0.5' and '3/6' another), other text lower-cased."""
    text = str(text).strip().strip(".").replace("$", "").replace(",", "").replace(" ", "")
    text = re.sub(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", text)
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return text.lower()
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def extract_answer(text: str) -> str | None:
    """The last \\boxed{…}, else the last number."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def math_answer(trajectory: dict, answer_key: str = "answer") -> tuple[float, dict]:
    """1.0 when the final answer (boxed, else the last number) equals the expected one, normalised."""
    expected = (trajectory.get("metadata") or {}).get(answer_key)
    if expected is None:
        raise ValueError(f"the trajectory's metadata has no {answer_key!r}")
    got = extract_answer(_final_text(trajectory))
    match = got is not None and normalise_answer(got) == normalise_answer(expected)
    return float(match), {"expected": str(expected), "extracted": got}


def regex_match(trajectory: dict, pattern: str, flags: str = "") -> float:
    """1.0 when the final answer matches ``pattern`` (flags: any of i, m, s)."""
    value = 0
    for flag in flags:
        value |= {"i": re.I, "m": re.M, "s": re.S}[flag]
    return float(bool(re.search(pattern, _final_text(trajectory), value)))


def json_valid(trajectory: dict) -> float:
    """1.0 when the final answer is JSON (a ```json fence around it is allowed)."""
    text = _final_text(trajectory).strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)
    try:
        json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return 0.0
    return 1.0


def tool_success_rate(trajectory: dict, failure_pattern: str = r"(?i)\b(error|traceback|exception|failed)\b"
                      ) -> tuple[float, dict]:
    """The share of tool results that do not look like failures; 1.0 when no tool ran."""
    results = [content_text(m.get("content")) for m in trajectory.get("messages") or [] if m.get("role") == "tool"]
    failed = sum(bool(re.search(failure_pattern, text)) for text in results)
    return (1.0 - failed / len(results) if results else 1.0), {"tool_results": len(results), "failed": failed}


def llm_judge(trajectory: dict, base_url: str, model: str, rubric: str, api_key_env: str | None = None,
              scale: float = 10.0, timeout: float = 60.0) -> tuple[float, dict]:
    """Asks any OpenAI-compatible endpoint to grade the trajectory against ``rubric``; the judge answers
    with "Score: N" (0..scale). Returns N / scale."""
    transcript = "\n".join(f"{m.get('role')}: {content_text(m.get('content'))}" for m in trajectory.get("messages") or [])
    final = _final_text(trajectory)
    body = {"model": model, "temperature": 0, "messages": [
        {"role": "system", "content": f"You grade an AI agent's work. Rubric:\n{rubric}\n"
                                      f"Answer with one line: Score: N, where N is from 0 to {scale:g}."},
        {"role": "user", "content": f"Conversation:\n{transcript}\n\nFinal answer:\n{final}"}]}
    headers = {"Content-Type": "application/json"}
    if api_key_env and os.environ.get(api_key_env):
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    request = urllib.request.Request(base_url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        reply = json.loads(response.read())["choices"][0]["message"]["content"] or ""
    found = re.search(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", reply, re.I)
    if not found:
        raise ValueError(f"the judge gave no score: {reply[:200]!r}")
    return max(0.0, min(1.0, float(found.group(1)) / scale)), {"judge": model, "reply": reply[:500]}
