"""Review in Datasette, in a real headless chromium: sign in, label a step bad, set a trajectory
reward; the rows are written and the next export changes. Anonymous visitors cannot write."""

import http.cookiejar
import json
import re
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request

import openai
import pytest

from .browser import CHROMIUM, Browser
from .conftest import STEPMILL, answers, free_port, wait_until


@pytest.fixture
def ui_with_link(proxy):
    port = free_port()
    process = subprocess.Popen(STEPMILL + ["ui", "--db", str(proxy.db), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []

    def link():
        line = process.stdout.readline()
        lines.append(line)
        return re.search(r"(http://\S+/-/auth-token\?token=\w+)", line)

    found = wait_until(link, timeout=60, what="the sign-in link stepmill ui prints")
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()  # a full pipe would block it
    # Datasette prints the link before its server listens: wait until it answers.
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/-/versions.json"), timeout=60, what="datasette listening")
    yield f"http://127.0.0.1:{port}", found.group(1)
    process.terminate()
    process.wait(15)


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
def test_a_reviewer_in_the_browser_changes_the_next_export(proxy, marker, ui_with_link, tmp_path):
    base, sign_in = ui_with_link
    trajectory = _two_steps(proxy, marker)
    first, second = proxy.trajectory_steps(trajectory, 2)
    before, _ = _export(proxy, trajectory)
    assert len(before) == 2
    with Browser(tmp_path) as browser:
        browser.go(f"{base}/-/stepmill/steps/{first['step_id']}")
        assert "Sign in to review" in browser.html() and "data-sm=\"label-bad\"" not in browser.html()
        browser.go(sign_in)  # Datasette's root sign-in link, printed by `stepmill ui`
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


def test_anonymous_writes_are_refused_and_named_reviewers_sign_in(proxy, marker, ui_with_link):
    base, _ = ui_with_link
    trajectory = _two_steps(proxy, marker)
    step = proxy.trajectory_steps(trajectory, 2)[0]
    form = urllib.parse.urlencode({"target": step["step_id"], "action": "label", "value": "bad",
                                   "next": "/-/stepmill/lifecycle"}).encode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(f"{base}/-/stepmill/review", data=form), timeout=10)
    assert refused.value.code == 403
    assert proxy.store().query("SELECT count(*) AS n FROM reviews WHERE target_id = ?", [step["step_id"]])[0]["n"] == 0

    link = subprocess.run(STEPMILL + ["reviewer", f"ana-{marker}", "--db", str(proxy.db), "--url", base],
                          capture_output=True, text=True, check=True).stdout.strip()
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    assert b"Lifecycle" in opener.open(link, timeout=10).read()
    opener.open(urllib.request.Request(f"{base}/-/stepmill/review", data=form), timeout=10).read()
    assert proxy.store().query("SELECT reviewer, value FROM reviews WHERE target_id = ?", [step["step_id"]]) == \
        [{"reviewer": f"ana-{marker}", "value": "bad"}]
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(f"{base}/-/stepmill/sign-in?token=not-a-token", timeout=10)
    assert wrong.value.code == 403
    lifecycle = json.loads(urllib.request.urlopen(f"{base}/-/stepmill/lifecycle.json", timeout=10).read())
    assert lifecycle["overall"][0]["collected"] >= 2 and lifecycle["overall"][0]["reviewed"] >= 1


def test_bound_beyond_localhost_nothing_is_shown_to_anonymous_visitors(tmp_path):
    from stepmill.store.ui import serve_args

    args = serve_args(tmp_path / "x.db", tmp_path, host="0.0.0.0", port=8001)
    assert json.loads((tmp_path / "datasette.json").read_text())["allow"] == {"id": "*"}
    assert "--root" in args
    serve_args(tmp_path / "x.db", tmp_path, host="127.0.0.1", port=8001)
    assert "allow" not in json.loads((tmp_path / "datasette.json").read_text())


def test_beyond_localhost_anonymous_visitors_see_nothing(proxy):
    port = free_port()
    process = subprocess.Popen(STEPMILL + ["ui", "--db", str(proxy.db), "--host", "0.0.0.0", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def status(path):
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    try:
        wait_until(lambda: status("/") is not None, timeout=60, what="datasette")
        name = proxy.db.stem
        for path in ("/", f"/{name}/steps", f"/{name}?sql=select+raw_request+from+steps", "/-/stepmill/lifecycle"):
            assert status(path) == 403, path
    finally:
        process.terminate()
        process.wait(15)


def test_search_finds_a_command_in_conversations(proxy, marker, ui_with_link):
    base, _ = ui_with_link
    client = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", max_retries=0)
    client.chat.completions.create(model="gpt-test", messages=[
        {"role": "user", "content": f"clean up with rm -rf build/ {marker}"}])
    proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    query = urllib.parse.urlencode({"q": f'"rm -rf" {marker}', "_shape": "objects"})
    rows = json.loads(urllib.request.urlopen(f"{base}/{proxy.db.stem}/search.json?{query}", timeout=10).read())["rows"]
    assert len(rows) >= 1 and all("rm -rf" in r["match"].replace("[", "").replace("]", "") for r in rows)


def test_a_drift_is_shown_where_it_is(proxy, marker, ui_with_link):
    base, _ = ui_with_link
    client = proxy.client()
    run = client.start_trajectory(trajectory_id=f"drift-{marker}")
    client.submit_step(trajectory_id=run["trajectory_id"], prompt_ids=[1, 2, 3], response_ids=[4, 5])
    child = client.submit_step(trajectory_id=run["trajectory_id"], prompt_ids=[1, 2, 3, 4, 9, 6], response_ids=[7])
    assert child["consistency"] == "divergent" and child["divergence_pos"] == 4
    page = urllib.request.urlopen(f"{base}/-/stepmill/steps/{child['step_id']}", timeout=10).read().decode()
    assert "Token drift at position 4" in page
    assert '<td class="sm-at">5' in page and '<td class="sm-at">9' in page  # parent's token, this prompt's token
