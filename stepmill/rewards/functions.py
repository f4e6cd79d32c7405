"""Reward functions shipped with stepmill, for `stepmill score` (see stepmill/rewards/scoring.py).

Each takes the trajectory (``messages``, ``completion``, ``metadata``, ``steps``) and options from
the configuration, and returns a score, or (score, details).
"""

from __future__ import annotations

import functools
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


def math_verified(trajectory: dict, answer_key: str = "answer") -> tuple[float, dict]:
    """1.0 when math-verify finds the final answer equal to the expected one (pip install math-verify):
    LaTeX or plain expressions, \\boxed{…} first, compared symbolically (1/2, 0.5 and \\frac{1}{2} are
    one answer; so are x^2+1 and 1+x^2)."""
    import threading

    from math_verify import parse, verify

    expected = (trajectory.get("metadata") or {}).get(answer_key)
    if expected is None:
        raise ValueError(f"the trajectory's metadata has no {answer_key!r}")
    # math-verify's time limits are SIGALRM's, which only the main thread has; elsewhere it runs without
    main = threading.current_thread() is threading.main_thread()
    limits = {} if main else {"parsing_timeout": None}
    gold = parse(str(expected), **limits) or parse(f"${expected}$", **limits)
    if not gold:
        raise ValueError(f"math-verify cannot read the expected answer {expected!r}")
    got = parse(_final_text(trajectory), **limits)
    match = bool(got) and verify(gold, got, **({} if main else {"timeout_seconds": None}))
    return float(match), {"expected": str(expected), "extracted": str(got[-1]) if got else None}


def reasoning_gym_score(trajectory: dict, key: str = "reasoning_gym", tag: str = "answer") -> tuple[float, dict]:
    """The task's own scorer (reasoning-gym's ``score_answer``, 0..1) on the final answer: the text
    between <answer> and </answer> (``tag``), else the last \\boxed{…}, else the whole final reply.
    The task is made again from its settings, as the dataset made it (``stepmill.runner.datasets``)."""
    from reasoning_gym.utils import extract_answer

    made = (trajectory.get("metadata") or {}).get(key)
    if not isinstance(made, dict):
        raise ValueError(f"the trajectory's metadata has no {key!r} (a reasoning-gym dataset's task)")
    dataset = _reasoning_gym_dataset(made["task"], json.dumps(made["settings"], sort_keys=True))
    entry = dataset[made["index"]]
    expected = (trajectory.get("metadata") or {}).get("answer")
    if expected is not None and str(entry["answer"]) != str(expected):
        raise ValueError(f"reasoning-gym now makes this task differently (made with {made.get('version')}): "
                         "score with the version that made it")
    text = _final_text(trajectory)
    answer = extract_answer(text, tag_name=tag) if tag else None
    if answer is None:
        boxed = _BOXED.findall(text)
        answer = boxed[-1] if boxed else text.strip()
    return float(dataset.score_answer(answer, entry)), {"expected": str(entry["answer"])[:500], "extracted": answer[:500]}


@functools.lru_cache(maxsize=32)
def _reasoning_gym_dataset(task: str, settings: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, **json.loads(settings))


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)


def python_completion(text: str, entry_point: str) -> str:
    """The code of a reply: the last fenced block that defines ``entry_point``, else the last fenced
    block, else the whole reply."""
    blocks = _FENCE.findall(text)
    defining = [b for b in blocks if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.M)]
    return (defining or blocks or [text])[-1]


def humaneval_tests(trajectory: dict, key: str = "humaneval", timeout: float = 10.0,
                    memory_mb: int = 1024) -> tuple[float, dict]:
    """1.0 when the final reply's function passes the task's tests, run in a sandbox of their own
    (``python_tests.py``: never in this process, no network, limits, a temporary folder). A reply
    with the whole function replaces the task's stub; one with only a body completes it."""
    from stepmill.rewards.python_tests import run_tests

    task = (trajectory.get("metadata") or {}).get(key)
    if not isinstance(task, dict):
        raise ValueError(f"the trajectory's metadata has no {key!r} (a HumanEval task)")
    entry_point, prompt = task["entry_point"], task["prompt"]
    code = python_completion(_final_text(trajectory), entry_point)
    whole = re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M)
    # the task's code first (its imports and helpers), then the reply's function in place of the stub
    source = f"{prompt}\n    pass\n\n{code}\n" if whole else prompt + code
    passed, reason = run_tests(prompt, source, task["test"], entry_point, timeout=timeout, memory_mb=memory_mb)
    return float(passed), {"result": reason}


@functools.lru_cache(maxsize=1)
def english_words() -> frozenset:
    """The allow-list of ``letters_diverse`` (stepmill/data/english-words.toml says what it is)."""
    import tomllib
    from importlib import resources

    text = (resources.files("stepmill") / "data" / "english-words.toml").read_text()
    return frozenset(tomllib.loads(text)["words"].split())


_LETTERS = re.compile(r"[A-Za-z]+")


@functools.lru_cache(maxsize=1)
def topic_word_lists() -> dict[str, frozenset]:
    """The word lists of ``topic_words`` by topic (stepmill/data/topic-words.toml says what they are)."""
    import tomllib
    from importlib import resources

    text = (resources.files("stepmill") / "data" / "topic-words.toml").read_text()
    return {name: frozenset(words.split()) for name, words in tomllib.loads(text)["topics"].items()}


def topic_words(trajectory: dict, topic_key: str = "topic", target: int = 16) -> tuple[float, dict]:
    """Distinct words of the task's topic list (``metadata[topic_key]`` names one of ``topic_word_lists``)
    over max(``target``, all the reply's words): sixteen different words of the list score 1.0 — words
    of this list, not every animal (a zebra is not in it, and a fly or a seal in prose counts).

    Words are the reply's runs of ASCII letters, lower-cased. A repeated name counts once but fills a
    place; an off-topic word fills a place and counts nothing; padding and punctuation add no word, so no
    trick but naming more different on-topic words raises the score."""
    topic = (trajectory.get("metadata") or {}).get(topic_key)
    lists = topic_word_lists()
    if topic not in lists:
        raise ValueError(f"the task's {topic_key!r} is {topic!r}; topics: {', '.join(sorted(lists))}")
    words = [w.lower() for w in _LETTERS.findall(_final_text(trajectory))]
    named = {w for w in words if w in lists[topic]}
    return len(named) / max(target, len(words)), {"words": len(words), "on_topic": len(named)}


def letters_diverse(trajectory: dict, target: int = 16, min_chars: int = 48, max_chars: int = 320,
                    other_weight: float = 0.25) -> tuple[float, dict]:
    """A reply of many different English words scores high; padding, repetition and noise do not.

    ``words`` are the reply's runs of ASCII letters, lower-cased. Each distinct word has a weight:
    1 when it is in the allow-list (``english_words``), ``other_weight`` for any other of three
    letters or more (so a policy that starts from random weights finds some signal at once), else 0.
    ``credit`` = Σ weight × (len + 1) over distinct words: the characters of a reply made of them alone.
    The score is the product of four shares, each in [0, 1]:
    coverage = min(1, Σ weight / target); distinct = distinct words / words (a repeated word lowers
    it); purity = min(1, credit / (characters + 1)) (spaces, punctuation, other words and repeats add
    characters, not credit); length = min(1, credit / min_chars, max_chars / characters).
    A reply without words is 0. No share grows when anything but a new word is added, so padding
    never raises the score."""
    text = _final_text(trajectory)
    words = [w.lower() for w in _LETTERS.findall(text)]
    if not words:
        return 0.0, {"words": 0}
    allowed = english_words()
    weights = {w: 1.0 if w in allowed else other_weight if len(w) >= 3 else 0.0 for w in set(words)}
    credit = sum(weight * (len(w) + 1) for w, weight in weights.items())
    shares = {"coverage": min(1.0, sum(weights.values()) / target), "distinct": len(weights) / len(words),
              "purity": min(1.0, credit / (len(text) + 1)),
              "length": min(1.0, credit / min_chars, max_chars / len(text))}
    score = shares["coverage"] * shares["distinct"] * shares["purity"] * shares["length"]
    known = sum(weight == 1.0 for weight in weights.values())
    return score, {"words": len(words), "known": known, **{k: round(v, 4) for k, v in shares.items()}}


def _reply_words(trajectory: dict) -> list[str]:
    """The final reply's words as ``topic_words`` reads them: runs of ASCII letters, lower-cased."""
    return [w.lower() for w in _LETTERS.findall(_final_text(trajectory))]


def words_off_topic(trajectory: dict, exclude_key: str = "exclude", target: int = 16) -> tuple[float, dict]:
    """Distinct English words (``english_words``) that are not of the topic list ``metadata[exclude_key]``
    names, over max(``target``, all the reply's words): sixteen different such words score 1.0.

    The mirror of ``topic_words``: a word of the excluded topic, an unknown word or a repeat fills a place
    and counts nothing; padding and punctuation add no word."""
    excluded = (trajectory.get("metadata") or {}).get(exclude_key)
    lists = topic_word_lists()
    if excluded not in lists:
        raise ValueError(f"the task's {exclude_key!r} is {excluded!r}; topics: {', '.join(sorted(lists))}")
    words = _reply_words(trajectory)
    counted = {w for w in words if w in english_words() and w not in lists[excluded]}
    return len(counted) / max(target, len(words)), {"words": len(words), "counted": len(counted)}


def words_exactly(trajectory: dict, count_key: str = "count") -> tuple[float, dict]:
    """A reply of exactly ``metadata[count_key]`` different English words scores 1.0: min(distinct known
    words, count) over max(count, all the reply's words). Known words: ``english_words`` and every
    ``topic_word_lists`` word. Fewer words score their share; each word past the count (known or not,
    new or repeated) lowers the score, so neither padding nor repetition nor length wins it."""
    count = (trajectory.get("metadata") or {}).get(count_key)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"the task's {count_key!r} is {count!r}: a whole number of words, 1 or more")
    words = _reply_words(trajectory)
    known = english_words().union(*topic_word_lists().values())
    distinct = {w for w in words if w in known}
    return min(len(distinct), count) / max(count, len(words)), {"words": len(words), "distinct_known": len(distinct)}
