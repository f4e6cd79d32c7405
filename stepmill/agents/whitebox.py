"""The host of white-box agents: token in, token out, every step submitted with its exact ids.

A white-box agent is a Python function ``run(task: dict, session: Session) -> str``. It builds
its prompt as token ids, calls ``session.generate(ids)`` — vLLM's token-in, token-out
``/inference/v1/generate`` where the engine serves it (its answer names the weight version that
sampled each token), else a ``/v1/completions`` request with the ids as the prompt and
``return_token_ids`` — and appends what the engine sampled to its own
sequence, so its trajectory is one exact token sequence by construction, never re-encoded.

The agent holds no stepmill credential: each generation is written as one JSON line, and the
rollout runner, which holds the write token, submits it through the control API. Under the
runner the lines go to a pipe of their own (``STEPMILL_STEPS_FD``) that the agent's tools do not
inherit and cannot open through ``/proc`` (this process is made non-dumpable), so a shell command
the model runs cannot forge a step; the runner takes only ids, logprobs, the finish reason and
the messages from them. Run by hand, the lines go to standard output; what the agent prints goes
to its log (standard error).

    echo '{"prompt": "What is 2 + 3?"}' | STEPMILL_ENGINE_URL=http://127.0.0.1:8000/v1 \\
        python -m stepmill.agents.whitebox stepmill.agents.token_loop:run
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from stepmill.errors import ConfigError


class EngineError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the engine's HTTP status, where it answered one


_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def qwen_reply(text: str) -> dict:
    """The chat message a Qwen reply stands for: ``<tool_call>`` blocks become ``tool_calls``."""
    calls = []
    for number, found in enumerate(_CALL.finditer(text)):
        try:
            call = json.loads(found.group(1))
        except ValueError:
            continue  # a malformed call stays in the text, as the model wrote it
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append({"id": f"call_{number}", "type": "function", "function": {
                "name": call["name"], "arguments": json.dumps(call.get("arguments") or {})}})
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": _CALL.sub("", text).strip(), "tool_calls": calls}


@dataclass
class Generation:
    ids: list[int]
    logprobs: list[float] | None
    text: str
    finish_reason: str | None
    message: dict  # the reply as a chat message (tool calls parsed)


class Session:
    """What a white-box agent may use: the tokenizer, the engine, and nothing of stepmill's."""

    def __init__(self, engine_url: str, model: str, tokenizer: str, out=None, timeout: float = 120.0,
                 seed: int | None = None):
        from tokenizers import Tokenizer

        self.engine_url = engine_url.rstrip("/")
        self.model = model
        folder = Path(tokenizer)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json" if folder.is_dir() else folder))
        self.out = out or sys.stdout
        self.timeout = timeout
        self.seed = seed  # each generation's sampling seed is this plus its number
        self.steps = 0
        self.root = re.sub(r"/v1/?$", "", self.engine_url.rstrip("/"))  # the token route lives beside /v1
        self.tokens_api: bool | None = None  # whether the engine has vLLM's token-in, token-out route

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def generate(self, prompt_ids: list[int], *, max_tokens: int = 512, messages: list[dict] | None = None,
                 reply=qwen_reply, **sampling) -> Generation:
        """One engine call on exact ids; the step (ids, logprobs, the weight versions that sampled them
        where the engine says, and — for people and reward functions to read — ``messages`` and the
        reply as ``reply(text)`` parses it) is emitted for the runner to submit."""
        sampling = {"max_tokens": max_tokens, "logprobs": 0, **sampling}
        if self.seed is not None and "seed" not in sampling:  # the runner's: a run and its paired control draw alike
            sampling["seed"] = self.seed + self.steps
        started_at = time.time()  # the policy version stamped, where the engine does not say, is the one in force then
        answer = self._tokens_api(prompt_ids, sampling) if self.tokens_api is not False else None
        if answer is None:
            answer = self._completions(prompt_ids, sampling)
        ids, logprobs, text, finish_reason, versions = answer
        message = reply(text)
        for number, call in enumerate(message.get("tool_calls") or []):
            call["id"] = f"call_{self.steps}_{number}"  # unique across the trajectory's turns
        generation = Generation(ids, logprobs if logprobs and len(logprobs) == len(ids) else None, text,
                                finish_reason, message)
        step = {"prompt_ids": prompt_ids, "response_ids": ids, "logprobs": generation.logprobs,
                "model": self.model, "finish_reason": generation.finish_reason,
                "messages": messages or [], "completion": generation.message, "started_at": started_at,
                "weight_versions": versions}
        self.out.write(json.dumps({k: v for k, v in step.items() if v is not None}) + "\n")
        self.out.flush()
        self.steps += 1
        return generation

    def _post(self, url: str, body: dict) -> dict:
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'sk-local')}"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise EngineError(f"the engine answered {exc.code}: {exc.read()[:500].decode(errors='replace')}",
                              exc.code) from None

    def _tokens_api(self, prompt_ids: list[int], sampling: dict):
        """vLLM's token-in, token-out route (``--enable-scale-out``): the same sampling, and for each
        output token the weight version that sampled it. None where the engine has no such route
        (asked once: an older vLLM, SGLang, the simulated LLM)."""
        body = {"model": self.model, "token_ids": prompt_ids, "sampling_params": sampling, "output_mode": "text"}
        try:
            payload = self._post(f"{self.root}/inference/v1/generate", body)
        except EngineError as exc:
            if self.tokens_api is None and exc.status in (403, 404, 405):  # no such route (vLLM: not enabled)
                self.tokens_api = False
                return None
            raise
        self.tokens_api = True
        choice = payload["choices"][0]
        if choice.get("token_ids") is None:
            raise EngineError("the engine's token route returned no token_ids")
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [entry.get("logprob") for entry in content]
        return (choice.get("token_ids"), logprobs or None, choice.get("text", ""), choice.get("finish_reason"),
                _spans(choice.get("weight_versions")))

    def _completions(self, prompt_ids: list[int], sampling: dict):
        body = {"model": self.model, "prompt": prompt_ids, "return_token_ids": True, **sampling}
        payload = self._post(f"{self.engine_url}/completions", body)
        choice = payload["choices"][0]
        if choice.get("token_ids") is None:
            raise EngineError("the engine returned no token_ids: a white-box agent needs an engine that "
                              "honours return_token_ids (vLLM, SGLang, or stepmill simulate-llm)")
        if choice.get("prompt_token_ids") not in (None, prompt_ids):
            raise EngineError("the engine reports other prompt ids than were sent")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        return choice["token_ids"], logprobs, choice.get("text", ""), choice.get("finish_reason"), None


def _spans(value) -> list[dict] | None:
    """The engine's weight versions over the output tokens: [{"version", "start", "end"}, …], or None."""
    if not isinstance(value, list):
        return None
    spans = [{"version": str(span["version"]), "start": int(span["start"]), "end": int(span["end"])}
             for span in value if isinstance(span, dict) and {"version", "start", "end"} <= span.keys()]
    return spans or None


def load_entry(entry: str):
    module, _, name = entry.partition(":")
    if not module or not name:
        raise ConfigError(f"{entry!r}: a white-box agent is 'module:function'")
    return getattr(importlib.import_module(module), name)


PR_SET_DUMPABLE = 4


def steps_channel():
    """Where steps go: the runner's pipe, kept from every child process, or else standard output."""
    fd = os.environ.pop("STEPMILL_STEPS_FD", None)
    if fd is None:
        return sys.stdout
    os.set_inheritable(int(fd), False)  # the agent's tools (subprocesses) never get it
    if sys.platform.startswith("linux"):
        import ctypes

        # Not dumpable: a process of the same user can no longer open /proc/<this pid>/fd/<fd>.
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    return os.fdopen(int(fd), "w", buffering=1)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    steps_out = steps_channel()
    sys.stdout = sys.stderr  # the agent's own prints go to its log
    try:
        task = json.loads(sys.stdin.read())
        session = Session(os.environ["STEPMILL_ENGINE_URL"], os.environ.get("STEPMILL_MODEL", "default"),
                          os.environ["STEPMILL_TOKENIZER"], out=steps_out,
                          seed=int(os.environ["STEPMILL_SEED"]) if os.environ.get("STEPMILL_SEED") else None)
        answer = load_entry(argv[0])(task, session)
    except Exception:
        traceback.print_exc()
        return 1
    print(f"answer: {answer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
