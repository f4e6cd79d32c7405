"""Review in Datasette, in a real headless chromium: sign in, label a step bad, set a trajectory
reward; the rows are written and the next export changes. Anonymous visitors read and write nothing."""

import json
import subprocess
import urllib.parse

import openai
import pytest

from .browser import CHROMIUM, UI, Browser
from .conftest import STEPMILL


@pytest.fixture
def ui(proxy):
    with UI(proxy.db) as ui:
        yield ui


def _two_steps(proxy, marker) -> str:
    client = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", max_retries=0,
                           default_headers={"X-Stepmill-Trajectory": f"review-{marker}"})
    messages = [{"role": "user", "content": f"review me {marker}"}]
    answer = client.chat.completions.create(model="gpt-test", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    client.chat.completions.create(model="gpt-test", messages=messages)
    return f"review-{marker}"


def _export(proxy, trajectory):
    done = subprocess.run(STEPMILL + ["export", "--db", str(proxy.db), "--no-tokens", "--where",
                                      "s.trajectory_id = :t", "-p", "t", trajectory],
                          capture_output=True, text=True, timeout=60)
    return [json.loads(line) for line in done.stdout.splitlines()], done.stderr


@pytest.mark.skipif(not CHROMIUM, reason="Debian's chromium is not installed")
def test_a_reviewer_in_the_browser_changes_the_next_export(proxy, marker, ui, tmp_path):
    base = ui.base
    trajectory = _two_steps(proxy, marker)
    first, second = proxy.trajectory_steps(trajectory, 2)
    before, _ = _export(proxy, trajectory)
    assert len(before) == 2
    with Browser(tmp_path) as browser:
        browser.go(f"{base}/-/stepmill/steps/{first['step_id']}")
        page = browser.html()  # anonymous: sent to the sign-in page, nothing of the step
        assert "Sign in to read" in page and "stepmill reviewer NAME" in page and marker not in page
        assert "data-sm=\"label-bad\"" not in page
        browser.go(ui.link)  # Datasette's root sign-in link, printed by `stepmill ui`
        browser.go(f"{base}/-/stepmill/steps/{first['step_id']}")
        browser.click("[data-sm=label-bad]")
        assert "label <strong>bad</strong>" in browser.html()
        browser.go(f"{base}/-/stepmill/trajectories/{trajectory}")
        browser.fill("[data-sm=reward-value]", "0.75")
        browser.click("[data-sm=reward]")
        page = browser.html()
        assert "reward <strong>0.75</strong>" in page and "history" in page
        browser.screenshot(tmp_path / "trajectory.png")
    store = proxy.store()
    assert store.query("SELECT reviewer, action, value FROM reviews WHERE target_id = ?", [first["step_id"]]) == \
        [{"reviewer": "root", "action": "label", "value": "bad"}]
    assert store.query("SELECT value, source, name FROM rewards WHERE target_id = ?", [trajectory]) == \
        [{"value": 0.75, "source": "human", "name": "root"}]
    after, summary = _export(proxy, trajectory)
    assert [s["step_id"] for s in after] == [second["step_id"]] and after[0]["reward"] == 0.75
    assert "1 step rejected" in summary
    assert (tmp_path / "trajectory.png").stat().st_size > 10_000


def test_anonymous_writes_are_refused_and_named_reviewers_sign_in(proxy, marker, ui):
    trajectory = _two_steps(proxy, marker)
    step = proxy.trajectory_steps(trajectory, 2)[0]
    form = urllib.parse.urlencode({"target": step["step_id"], "action": "label", "value": "bad",
                                   "next": "/-/stepmill/lifecycle"}).encode()
    assert ui.get("/-/stepmill/review", anonymous=True, data=form)[0] == 403
    assert proxy.store().query("SELECT count(*) AS n FROM reviews WHERE target_id = ?", [step["step_id"]])[0]["n"] == 0

    link = subprocess.run(STEPMILL + ["reviewer", f"ana-{marker}", "--db", str(proxy.db), "--url", ui.base],
                          capture_output=True, text=True, check=True).stdout.strip()
    ana = ui.sign_in(link)
    status, page, _ = ui.get("/-/stepmill/lifecycle", jar=ana)
    assert status == 200 and "Lifecycle" in page
    status, _, headers = ui.get("/-/stepmill/review", jar=ana, data=form)
    assert status == 302 and headers["location"] == "/-/stepmill/lifecycle"
    assert proxy.store().query("SELECT reviewer, value FROM reviews WHERE target_id = ?", [step["step_id"]]) == \
        [{"reviewer": f"ana-{marker}", "value": "bad"}]
    status, page, _ = ui.get("/-/stepmill/sign-in?token=not-a-token", anonymous=True)
    assert status == 403 and "Unknown or replaced reviewer token" in page
    assert ui.get("/-/stepmill/lifecycle.json", anonymous=True)[0] == 403
    status, body, _ = ui.get("/-/stepmill/lifecycle.json", jar=ana)
    lifecycle = json.loads(body)
    assert lifecycle["overall"][0]["collected"] >= 2 and lifecycle["overall"][0]["reviewed"] >= 1


def test_datasette_is_told_that_only_signed_in_actors_read_wherever_it_listens(tmp_path):
    from stepmill.ui.settings import serve_args

    for host in ("0.0.0.0", "127.0.0.1"):
        args = serve_args(tmp_path / "x.db", tmp_path, host=host, port=8001)
        assert json.loads((tmp_path / "datasette.json").read_text())["allow"] == {"id": "*"}
        assert "--root" in args


def test_beyond_localhost_anonymous_visitors_see_nothing(proxy):
    name = proxy.db.stem
    with UI(proxy.db, host="0.0.0.0") as ui:
        for path in ("/", f"/{name}/steps", f"/{name}?sql=select+raw_request+from+steps", "/-/stepmill/lifecycle"):
            status, _, headers = ui.get(path, anonymous=True)
            assert (status, headers["location"]) == (302, "/-/stepmill/sign-in"), path
        for path in (f"/{name}/steps.json", f"/{name}/-/query.json?sql=select+raw_request+from+steps"):
            assert ui.get(path, anonymous=True)[0] == 403, path
        assert ui.get(f"/{name}/steps.json")[0] == 200  # signed in through the link it printed


def test_search_finds_a_command_in_conversations(proxy, marker, ui):
    client = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", max_retries=0)
    client.chat.completions.create(model="gpt-test", messages=[
        {"role": "user", "content": f"clean up with rm -rf build/ {marker}"}])
    proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    query = urllib.parse.urlencode({"q": f'"rm -rf" {marker}', "_shape": "objects"})
    status, body, _ = ui.get(f"/{proxy.db.stem}/search.json?{query}")
    rows = json.loads(body)["rows"]
    assert len(rows) >= 1 and all("rm -rf" in r["match"].replace("[", "").replace("]", "") for r in rows)


def test_search_finds_a_step_no_writer_has_indexed_yet(tmp_path):
    """Steps enter the full-text index after their commit; a search through the UI brings it up to
    date first (here steps written straight to a file no writer serves, so nothing else indexes them)."""
    from stepmill.store import StepRecord, Store

    store = Store(tmp_path / "quiet.db")
    try:
        steps = [store.record_step(StepRecord(api="openai.chat", messages=[
            {"role": "user", "content": f"unindexed {word}"}], completion={"role": "assistant", "content": "ok"}))
            for word in ("kestrel", "osprey")]
        assert store.search_behind() == 2
    finally:
        store.close()
    with UI(tmp_path / "quiet.db") as ui:
        status, body, _ = ui.get("/quiet/search.json?" + urllib.parse.urlencode({"q": "kestrel", "_shape": "objects"}))
        assert status == 200 and [row["id"] for row in json.loads(body)["rows"]] == steps[:1]
        status, body, _ = ui.get("/quiet/steps.json?" + urllib.parse.urlencode({"_search": "osprey", "_shape": "objects"}))
        assert status == 200 and [row["id"] for row in json.loads(body)["rows"]] == steps[1:]


def test_a_drift_is_shown_where_it_is(proxy, marker, ui):
    client = proxy.client()
    run = client.start_trajectory(trajectory_id=f"drift-{marker}")
    client.submit_step(trajectory_id=run["trajectory_id"], prompt_ids=[1, 2, 3], response_ids=[4, 5])
    child = client.submit_step(trajectory_id=run["trajectory_id"], prompt_ids=[1, 2, 3, 4, 9, 6], response_ids=[7])
    assert child["consistency"] == "divergent" and child["divergence_pos"] == 4
    status, page, _ = ui.get(f"/-/stepmill/steps/{child['step_id']}")
    assert "Token drift at position 4" in page
    assert '<td class="sm-at">5' in page and '<td class="sm-at">9' in page  # parent's token, this prompt's token
