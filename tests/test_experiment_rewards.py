"""The experiments' other two rewards and their bundled datasets: ``words_off_topic`` (sixteen different
English words that are not animals, notanimals16) and ``words_exactly`` (exactly eight different English
words, words8). Like topic_words, padding, punctuation and repetition never raise either."""

import json
from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepmill.rewards import functions

from .test_train_rewards import trajectory

ANIMALS = sorted(functions.topic_word_lists()["animals"])
PLAIN = sorted(functions.english_words() - set(ANIMALS))  # English words that are not in the animals list
KNOWN = sorted(functions.english_words() | set(ANIMALS))
padding = st.sampled_from([" ", "  ", "\n", "\t", ".", ",", "!", " - ", "...", "; ", "\n\n"])


def off_topic(reply: str) -> float:
    return functions.words_off_topic(trajectory(reply, exclude="animals"))[0]


def exactly(reply: str, count: int = 8) -> float:
    return functions.words_exactly(trajectory(reply, count=count))[0]


# -- words_off_topic ---------------------------------------------------------------------------------
def test_sixteen_different_plain_words_score_full_and_animals_dilute():
    assert off_topic(" ".join(PLAIN[:16])) == 1.0
    assert off_topic(" ".join(PLAIN[:8])) == 0.5
    assert off_topic(" ".join(PLAIN[:8] + ANIMALS[:8])) == 0.5
    assert off_topic(" ".join(PLAIN[:16] + ANIMALS[:16])) == 16 / 32
    value, details = functions.words_off_topic(trajectory("Table, table! cat and zzqx", exclude="animals"))
    assert details == {"words": 5, "counted": 2} and value == 2 / 16


@given(st.lists(st.sampled_from(PLAIN), min_size=1, max_size=15, unique=True), st.sampled_from(PLAIN + ANIMALS))
def test_one_more_different_plain_word_helps_and_an_animal_or_repeat_never(words, extra):
    reply = " ".join(words)
    if extra in words or extra in ANIMALS:
        assert off_topic(reply + " " + extra) <= off_topic(reply)
    else:
        assert off_topic(reply + " " + extra) > off_topic(reply)


@given(st.lists(st.sampled_from(PLAIN + ANIMALS), max_size=30), padding, st.integers(1, 40))
def test_off_topic_padding_and_repetition_never_raise_the_score(words, pad, times):
    reply = " ".join(words)
    assert off_topic(reply + pad) == off_topic(reply)
    assert off_topic(pad.join(words)) == off_topic(reply)
    assert off_topic(" ".join([reply] * times)) <= off_topic(reply) + 1e-12
    assert 0.0 <= off_topic(reply) <= 1.0


def test_a_task_without_a_known_excluded_topic_is_an_error():
    with pytest.raises(ValueError, match="topics: animals"):
        functions.words_off_topic(trajectory("table chair", exclude="planets"))
    with pytest.raises(ValueError):
        functions.words_off_topic(trajectory("table chair"))


# -- words_exactly -----------------------------------------------------------------------------------
def test_exactly_the_count_of_different_words_scores_full():
    assert exactly(" ".join(KNOWN[:8])) == 1.0
    assert exactly(" ".join(KNOWN[:4])) == 0.5
    assert exactly(" ".join(KNOWN[:16])) == 0.5
    assert exactly(" ".join(KNOWN[:7] + ["zzqx"])) == 7 / 8
    assert exactly("") == 0.0 and exactly("!!! ...") == 0.0
    value, details = functions.words_exactly(trajectory("Cat, cat table", count=3))
    assert details == {"words": 3, "distinct_known": 2} and value == 2 / 3


@given(st.integers(1, 20), st.lists(st.sampled_from(KNOWN), max_size=30, unique=True))
def test_nothing_beats_exactly_count_different_words(count, words):
    assert exactly(" ".join(words), count) <= exactly(" ".join(KNOWN[:count]), count) == 1.0


@given(st.integers(1, 20), st.lists(st.sampled_from(KNOWN), min_size=20, max_size=30, unique=True),
       st.sampled_from(KNOWN + ["zzqx"]))
def test_once_count_different_words_are_named_a_further_word_never_helps(count, words, extra):
    reply = " ".join(words)  # at least 20 different known words: the count is reached
    assert exactly(reply + " " + extra, count) < exactly(reply, count)


@given(st.integers(1, 20), st.lists(st.sampled_from(KNOWN), max_size=30), padding, st.integers(1, 40))
def test_exactly_padding_and_repetition_never_raise_the_score(count, words, pad, times):
    reply = " ".join(words)
    assert exactly(reply + pad, count) == exactly(reply, count)
    assert exactly(pad.join(words), count) == exactly(reply, count)
    assert exactly(" ".join([reply] * times), count) <= exactly(reply, count) + 1e-12
    assert 0.0 <= exactly(reply, count) <= 1.0


@pytest.mark.parametrize("count", [0, -1, "8", None, True, 2.5])
def test_a_task_without_a_whole_count_is_an_error(count):
    with pytest.raises(ValueError, match="whole number"):
        functions.words_exactly(trajectory("table chair", count=count))


# -- the bundled datasets ----------------------------------------------------------------------------
@pytest.mark.parametrize("name,keys", [("notanimals16.jsonl", {"exclude"}), ("words8.jsonl", {"count"})])
def test_the_bundled_prompts(name, keys):
    rows = [json.loads(line) for line in (resources.files("stepmill") / "data" / name).read_text().splitlines()]
    assert len(rows) == 16 and len({r["id"] for r in rows}) == 16 and len({r["prompt"] for r in rows}) == 16
    assert all(set(r) == {"id", "prompt", *keys} for r in rows)
    for row in rows:  # each task's reward reads its metadata without an error
        reward = functions.words_off_topic if "exclude" in keys else functions.words_exactly
        assert reward(trajectory("table chair", **row))[0] >= 0.0
