"""The control API's request checks: a JSON object body, and field specs each a (test, what it must be).

A body that fails a check raises ``BadInput`` with a sentence naming the field, so a caller learns
what to fix; the store is never reached with a value it cannot hold (text with lone surrogates,
integers past SQLite's 64 bits).
"""

from __future__ import annotations

import json
import math
from numbers import Real
from typing import Any, Callable

from stepmill.errors import BadInput
from stepmill.store.encoding import INT64

Spec = tuple[Callable[[Any], bool], str]  # (test, what the value must be)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def json_object(body: bytes) -> dict:
    """The body as a JSON object ({} when empty)."""
    if not body:
        return {}
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadInput("body is nested too deeply") from None
    if not isinstance(value, dict):
        raise BadInput("body must be a JSON object")
    return value


def check(body: dict, spec: dict[str, Spec], required: tuple = ()) -> dict:
    """``body`` itself, once every field is known to ``spec``, the required ones given and all pass."""
    for name in body:
        if name not in spec:
            raise BadInput(f"unknown field {name!r}; expected some of: {', '.join(sorted(spec))}")
    for name in required:
        if body.get(name) is None:
            raise BadInput(f"field {name!r} is required")
    for name, value in body.items():
        test, what = spec[name]
        if value is not None and not test(value):
            raise BadInput(f"field {name!r} must be {what}")
    return body


def is_int64(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -INT64 <= value < INT64


def is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 for x in value)


def is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) and abs(value) < 1e300


def is_text(value) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


def is_clean(value) -> bool:
    """JSON values SQLite and UTF-8 can hold: text without lone surrogates, integers within 64 bits."""
    if isinstance(value, str):
        return is_text(value)
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return is_int64(value)
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(is_clean(v) for v in value)
    if isinstance(value, dict):
        return all(is_text(k) and is_clean(v) for k, v in value.items())
    return False


STRING: Spec = (lambda v: isinstance(v, str) and 0 < len(v) <= 200 and is_text(v), "a non-empty string")
NUMBER: Spec = (is_number, "a number")
OBJECT: Spec = (lambda v: isinstance(v, dict) and is_clean(v), "an object (text without lone surrogates)")
IDS: Spec = (is_ids, "a list of token ids (non-negative integers)")
VERSION: Spec = (lambda v: (isinstance(v, str) and 0 < len(v) <= 200 and is_text(v))
                 or (isinstance(v, int) and not isinstance(v, bool) and abs(v) < INT64), "a string or an integer")
TEXT: Spec = (lambda v: isinstance(v, str) and len(v) <= 10000 and is_text(v), "a string")
SOURCE: Spec = (lambda v: v in ("rule", "model", "human", "env", "api"), "one of rule, model, human, env, api")
FLAG: Spec = (lambda v: isinstance(v, bool), "true or false")

STEP_FIELDS: dict[str, Spec] = {
    "prompt_ids": IDS,
    "response_ids": IDS,
    "logprobs": (lambda v: isinstance(v, list) and all(is_number(x) for x in v), "a list of numbers"),
    "reward": NUMBER,
    "trajectory_id": STRING,
    "group_id": STRING,
    "parent_step_id": STRING,
    "step_index": (lambda v: is_int64(v) and v >= 0, "a non-negative integer below 2^63"),
    "policy_version": VERSION,
    "started_at": NUMBER,  # when the generation began (epoch seconds): the version in effect then is stamped
    "is_last": FLAG,
    "metadata": OBJECT,
    "messages": (lambda v: isinstance(v, list) and all(isinstance(m, dict) for m in v) and is_clean(v),
                 "a list of message objects"),
    "completion": OBJECT,
    "model": STRING,
    "channel": STRING,
    "finish_reason": STRING,
}
# ``scoring``: a task's fields for reward functions only (answers, tests), kept apart from the metadata
# every reader sees; written, never answered.
TRAJECTORY_FIELDS: dict[str, Spec] = {"trajectory_id": STRING, "group_id": STRING, "channel": STRING,
                                      "metadata": OBJECT, "scoring": OBJECT}
REWARD_FIELDS: dict[str, Spec] = {"target": STRING, "value": NUMBER, "source": SOURCE, "name": STRING, "note": TEXT,
                                  "details": OBJECT, "idempotency_key": STRING}
FEEDBACK_FIELDS: dict[str, Spec] = {"response_id": STRING, "step_id": STRING, "trajectory_id": STRING,
                                    "score": NUMBER, "thumbs": (lambda v: v in ("up", "down"), '"up" or "down"'),
                                    "comment": TEXT, "idempotency_key": STRING}
REVIEW_FIELDS: dict[str, Spec] = {"target": STRING, "action": STRING, "value": TEXT, "reviewer": STRING}
