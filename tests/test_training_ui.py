"""The training page in a real headless chromium, on a store filled the way `stepmill train` fills it
(``record_train_metrics`` per version, for a run and its paired control): the reward chart draws both
runs with a point per version, the table shows the recorded numbers, a sync whose logprob gap is over
the tolerance is highlighted, and a file with no training says so.

``STEPMILL_SCREENSHOTS=docs/screenshots`` also saves the page there (training.png)."""

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stepmill.store import Store
from stepmill.ui.training import TOLERANCE, fmt, plot

from .browser import CHROMIUM, UI, Browser

needs_chromium = pytest.mark.skipif(not CHROMIUM, reason="Debian's chromium is not installed")

VERSIONS = 8
OVER = 5  # the version whose sync left the engine's logprobs too far from the trainer's


def _run(version: int) -> dict:
    """A run that learns: reward climbs, diversity slips a little, one sync over the tolerance."""
    return {"reward": round(0.25 + 0.06 * version, 4), "val_reward": round(0.22 + 0.05 * version, 4)
            if version % 2 == 0 else None,
            "logprob_gap": 2.4e-4 if version == OVER else round(3e-6 * (version + 1), 9),
            "rollout_gap": round(0.002 + 0.0005 * version, 6), "staleness_mean": 0.5 if version else 0.0,
            "staleness_max": 1.0 if version else 0.0, "distinct_2": round(0.82 - 0.01 * version, 4),
            "repetition": round(0.05 + 0.004 * version, 4), "unique_responses": 0.9, "response_tokens": 41.5,
            "sync_s": round(2.1 + 0.1 * version, 2), "engine_paused_s": 0.8, "rollout_s": 12.4, "train_s": 3.3,
            "loss": round(0.12 - 0.01 * version, 4), "clip_fraction": 0.04, "grad_norm": 1.7}


def _control(version: int) -> dict:
    """Same tasks and seeds, no optimizer step: reward flat."""
    return {"reward": round(0.27 + (0.01 if version % 2 else -0.01), 4), "logprob_gap": 2e-6,
            "distinct_2": 0.83, "repetition": 0.05, "sync_s": 0.0}


@pytest.fixture
def trained(tmp_path):
    db = tmp_path / "train.db"
    store = Store(str(db))
    for version in range(VERSIONS):
        store.record_train_metrics("train-control", version, _control(version))
        store.record_train_metrics("train", version, _run(version))
    store.record_train_metrics("solo", 0, {"reward": 0.5})  # a run recorded without its control
    store.close()
    return db


SERIES = """[...document.querySelectorAll('#sm-train-reward [data-sm=series]')].map(g => [g.dataset.series,
    [...g.querySelectorAll('circle')].map(c => [+c.dataset.version, +c.dataset.value, +c.getAttribute('cy')]),
    (g.querySelector('polyline')?.getAttribute('points') || '').split(' ').filter(Boolean).length])"""
CELLS = """Object.fromEntries([...document.querySelectorAll('[data-sm=train-table] tbody tr')].map(tr =>
    [tr.dataset.version, Object.fromEntries([...tr.querySelectorAll('td[data-key]')].map(td =>
        [td.dataset.key, td.textContent.trim()]))]))"""


@needs_chromium
@pytest.mark.timeout(180)
def test_the_training_page_draws_a_run_beside_its_control(trained, tmp_path):
    run = {v: _run(v) for v in range(VERSIONS)}
    control = {v: _control(v) for v in range(VERSIONS)}
    with UI(trained) as ui, Browser(tmp_path / "browser") as browser:
        browser.sign_in_as(ui)
        browser.viewport(1400, 1000)
        browser.go(f"{ui.base}/-/stepmill/lifecycle")
        browser.click("[data-sm=training-link]")  # the dashboard leads here
        assert browser.evaluate("location.pathname") == "/-/stepmill/training"
        assert browser.evaluate("document.querySelector('[data-sm=run]').textContent") == "train"
        assert browser.evaluate("document.querySelector('[data-sm=control]').textContent") == "train-control"

        series = {key: (points, drawn) for key, points, drawn in browser.evaluate(SERIES)}
        assert set(series) == {"run", "control", "val"}
        for key, recorded in (("run", run), ("control", control)):
            points, drawn = series[key]
            assert drawn == VERSIONS
            assert [p[:2] for p in points] == [[v, recorded[v]["reward"]] for v in range(VERSIONS)]
        val_points, val_drawn = series["val"]
        assert [p[0] for p in val_points] == [0, 2, 4, 6] and val_drawn == 4
        # higher reward is drawn higher (smaller y): the run's climbing line rises, ends above the control's
        run_y = [p[2] for p in series["run"][0]]
        assert run_y == sorted(run_y, reverse=True) and run_y[-1] < series["control"][0][-1][2]
        box = browser.evaluate("(r => [r.width, r.height])(document.getElementById('sm-train-reward')"
                               ".getBoundingClientRect())")
        assert box[0] > 500 and box[1] > 200  # drawn, not collapsed

        cells = browser.evaluate(CELLS)
        assert sorted(cells, key=int) == [str(v) for v in range(VERSIONS)]
        for v in range(VERSIONS):
            row = cells[str(v)]
            assert row["reward"] == fmt(run[v]["reward"], "reward")
            assert row["control_reward"] == fmt(control[v]["reward"], "reward")
            assert row["val_reward"] == fmt(run[v]["val_reward"], "reward")
            assert row["logprob_gap"].rstrip(" ⚠") == fmt(run[v]["logprob_gap"], "gap")
            assert row["rollout_gap"] == fmt(run[v]["rollout_gap"], "gap")
            assert row["staleness_mean"] == fmt(run[v]["staleness_mean"])
            assert row["distinct_2"] == fmt(run[v]["distinct_2"], "share")
            assert row["repetition"] == fmt(run[v]["repetition"], "share")
            assert row["sync_s"] == fmt(run[v]["sync_s"], "seconds")
        assert cells["1"]["val_reward"] == "—"  # not measured that version
        assert cells["0"]["reward"] == "0.250" and cells["5"]["logprob_gap"] == "2.40e-04 ⚠"

        over = browser.evaluate("[...document.querySelectorAll('[data-sm=gap-over]')].map(td => "
                                "[td.closest('tr').dataset.version, getComputedStyle(td).backgroundColor])")
        assert over == [[str(OVER), "rgb(255, 225, 225)"]]  # only that version, and visibly marked
        within = browser.evaluate("getComputedStyle(document.querySelector("
                                  "'tr[data-version=\"4\"] td[data-key=logprob_gap]')).backgroundColor")
        assert within != "rgb(255, 225, 225)"
        assert browser.evaluate("document.querySelector('[data-sm=tolerance]').textContent") == f"{TOLERANCE:g}"
        assert "1 version over it: 5" in browser.evaluate("document.querySelector('[data-sm=over-count]').textContent")
        # the gap chart marks the tolerance, and the spike is drawn above that line
        mark_y = browser.evaluate("+document.querySelector('#sm-train-gap [data-sm=mark]').getAttribute('y1')")
        gaps = browser.evaluate("[...document.querySelectorAll('#sm-train-gap circle')].map(c => "
                                "[+c.dataset.version, +c.getAttribute('cy')])")
        assert len(gaps) == VERSIONS
        assert [v for v, y in gaps if y < mark_y] == [OVER]

        # the margin: mean reward of the last three versions, run minus control
        last = range(VERSIONS - 3, VERSIONS)
        margin = sum(run[v]["reward"] for v in last) / 3 - sum(control[v]["reward"] for v in last) / 3
        shown = browser.evaluate("document.querySelector('[data-sm=margin-value]').textContent")
        assert shown == f"{margin:+.4f}" and margin > 0
        assert browser.evaluate("document.querySelector('[data-sm=margin-value]').className").endswith("sm-pos")
        if os.environ.get("STEPMILL_SCREENSHOTS"):
            browser.screenshot(Path(os.environ["STEPMILL_SCREENSHOTS"]) / "training.png", full_page=True)

        # another run, chosen from the page: no control, no margin
        others = browser.evaluate("[...document.querySelectorAll('[data-sm=runs] a')].map(a => a.textContent)")
        assert others == ["solo"]
        browser.click("[data-sm=runs] a")
        assert browser.evaluate("document.querySelector('[data-sm=run]').textContent") == "solo"
        assert not browser.evaluate("document.querySelector('[data-sm=control]')")
        assert browser.evaluate("document.querySelectorAll('#sm-train-reward circle').length") == 1

        # the same numbers as JSON; an unknown run is not found; only signed-in readers see any of it
        data = json.loads(ui.get("/-/stepmill/training.json?run=train")[1])
        assert [r["values"]["reward"] for r in data["rows"]] == [run[v]["reward"] for v in range(VERSIONS)]
        assert [r["version"] for r in data["rows"] if r["gap_over"]] == [OVER]
        loose = json.loads(ui.get("/-/stepmill/training.json?run=train&tolerance=1e-3")[1])
        assert not [r for r in loose["rows"] if r["gap_over"]]
        assert ui.get("/-/stepmill/training.json?run=nope")[0] == 404
        assert ui.get("/-/stepmill/training?tolerance=-1")[0] == 400
        status, _, headers = ui.get("/-/stepmill/training", anonymous=True)
        assert (status, headers["location"]) == (302, "/-/stepmill/sign-in")
        assert ui.get("/-/stepmill/training.json", anonymous=True)[0] == 403


@needs_chromium
@pytest.mark.timeout(120)
def test_the_training_page_says_when_nothing_was_trained(tmp_path):
    db = tmp_path / "empty.db"
    Store(str(db)).close()
    with UI(db) as ui, Browser(tmp_path / "browser") as browser:
        browser.sign_in_as(ui)
        browser.go(f"{ui.base}/-/stepmill/training")
        said = browser.evaluate("document.querySelector('[data-sm=no-training]')?.textContent || ''")
        assert "No training recorded" in said and "stepmill train" in said
        assert browser.evaluate("document.querySelectorAll('svg[data-sm=chart], [data-sm=train-table]').length") == 0
        assert json.loads(ui.get("/-/stepmill/training.json")[1])["rows"] == []


values = st.floats(-1e6, 1e6, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), values | st.none()), min_size=1, max_size=40, unique_by=lambda p: p[0]),
       st.booleans())
def test_the_chart_keeps_points_in_the_frame_and_in_order(points, log):
    if log:
        points = [(v, None if x is None else abs(x)) for v, x in points]
    chart = plot([("r", "run", points)], log=log, marks=[("tolerance", TOLERANCE)] if log else [])
    drawn = chart["series"][0]["points"]
    assert [p["version"] for p in drawn] == sorted(v for v, x in points if x is not None)
    for p in drawn:
        assert chart["left"] <= p["x"] <= chart["right"] and chart["top"] <= p["y"] <= chart["bottom"]
    for a, b in zip(drawn, drawn[1:]):
        assert a["x"] < b["x"] or len(drawn) == 1
    by_value = sorted(drawn, key=lambda p: p["value"])
    assert all(a["y"] >= b["y"] for a, b in zip(by_value, by_value[1:]))  # more is drawn higher
    for tick in chart["yticks"] + chart["marks"]:
        assert chart["top"] - 0.1 <= tick["y"] <= chart["bottom"] + 0.1


@given(st.none() | st.floats(-1e12, 1e12, allow_nan=False),
       st.sampled_from(["number", "reward", "share", "gap", "seconds"]))
def test_a_number_always_shows(value, kind):
    shown = fmt(value, kind)
    if value is None:
        assert shown == "—"
    else:
        assert float(shown) == pytest.approx(value, rel=0.01, abs=0.0051)
