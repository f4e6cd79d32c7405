"""The two processes of a Python test run (``python_tests.py`` starts them; standard library only,
run with ``python -I -S -c``): the checker holds the task's tests and calls the candidate, which
holds only the completion, through a pipe. The candidate's process never has the tests, neither as
a file nor in its memory, so it cannot read expected values off them.

Values cross the pipe as tagged JSON (no pickle: the checker decodes only plain data from the
candidate): lists stay JSON lists; floats, tuples, dicts, sets and bytes are one-key objects.
"""

import json
import os
import sys

MAX_LINE = 16 * 1024 * 1024  # a candidate's answer longer than this is a failure, not a memory hog


def encode(value):
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}  # inf and nan too
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, (set, frozenset)):
        return {"set": [encode(v) for v in value]}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    raise TypeError(f"a value of type {type(value).__name__} cannot be passed")


def decode(value):
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise ValueError("a malformed value")
    (tag, inner), = value.items()
    if tag == "float":
        return float(inner)
    if tag == "tuple":
        return tuple(decode(v) for v in inner)
    if tag == "dict":
        return {decode(k): decode(v) for k, v in inner}
    if tag == "set":
        return {decode(v) for v in inner}
    if tag == "bytes":
        return bytes.fromhex(inner)
    raise ValueError(f"an unknown tag {tag!r}")


def candidate(path, entry_point):
    """Load the completion, then answer calls: one JSON line in, one out. Its own prints go nowhere."""
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)

    def answer(message):
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    namespace = {"__name__": "candidate"}
    try:
        with open(path) as handle:
            source = handle.read()
        exec(compile(source, "candidate.py", "exec"), namespace)
        function = namespace[entry_point]
    except BaseException as exc:  # noqa: BLE001  (whatever the completion raises is its failure)
        answer({"error": f"the completion does not load: {type(exc).__name__}: {exc}"[:500]})
        return
    answer({"ready": True})
    for line in requests:
        try:
            result = {"value": encode(function(*decode(json.loads(line))))}
        except BaseException as exc:  # noqa: BLE001
            result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        answer(result)


class CandidateFailed(Exception):
    pass


def checker():
    """Run the task's tests (from stdin, never a file) against the candidate started by the command given."""
    import subprocess

    spec = json.loads(sys.stdin.read())
    # The sandbox's own complaints (bwrap, setpriv) reach the scorer; the completion's prints do not.
    process = subprocess.Popen(spec["candidate"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def receive():
        line = process.stdout.readline(MAX_LINE)
        if not line.endswith("\n"):
            raise CandidateFailed("the completion's process ended or answered too much")
        message = json.loads(line)
        if "error" in message:
            raise CandidateFailed(str(message["error"]))
        return message

    def call(*args):
        process.stdin.write(json.dumps(encode(list(args))) + "\n")
        process.stdin.flush()
        return decode(receive()["value"])

    try:
        receive()  # ready, or why the completion does not load
        namespace = {"__name__": "tests"}
        exec(compile(spec["prefix"] + "\n" + spec["test"] + "\n", "tests.py", "exec"), namespace)
        namespace[spec["entry_point"]] = call  # some tests name the function instead of their argument
        namespace["check"](call)
        outcome = {"passed": True, "reason": "passed"}
    except AssertionError as exc:
        outcome = {"passed": False, "reason": f"failed: a test's assertion{': ' + str(exc) if str(exc) else ''}"}
    except CandidateFailed as exc:
        outcome = {"passed": False, "reason": f"failed: {exc}"}
    except Exception as exc:  # noqa: BLE001  (what the candidate sent broke a test: a failure)
        outcome = {"passed": False, "reason": f"failed: {type(exc).__name__}: {exc}"}
    finally:
        process.kill()
        process.wait()
    print(json.dumps({**outcome, "reason": outcome["reason"][:500]}))


if __name__ == "__main__":
    if sys.argv[1] == "candidate":
        candidate(sys.argv[2], sys.argv[3])
    else:
        checker()
