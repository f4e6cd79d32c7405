"""The dashboard in a real headless chromium: the live page follows a real rollout without reloading,
the group page draws the prefix tree the bridge packs, the lifecycle page's charts draw a demo run,
tool results sit beside their calls, and agents are the runner's names.

``STEPMILL_SCREENSHOTS=docs/screenshots`` also saves each page of the demo run there."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stepmill.store import Store
from stepmill.store.views import LIVE
from stepmill.ui.datasette_plugin import stepmill_path

from .browser import CHROMIUM, UI, Browser
from .conftest import STEPMILL
from .test_rollout import _config

needs_chromium = pytest.mark.skipif(not CHROMIUM, reason="Debian's chromium is not installed")
NUMBER = "Number(document.querySelector('[data-sm=live-{}]').textContent)"
# A slow black-box agent: waits, runs the shipped tool loop through the proxy, waits again.
SLOW_AGENT = [sys.executable, "-c", ("import runpy, sys, time\ntime.sleep(3)\n"
                                    "sys.argv = ['tool_loop', '--model', 'gpt-test']\n"
                                    "try:\n    runpy.run_module('stepmill.agents.tool_loop', run_name='__main__', "
                                    "alter_sys=True)\nfinally:\n    time.sleep(3)")]


@pytest.mark.slow  # a whole rollout watched in the browser: about a minute
@needs_chromium
@pytest.mark.timeout(240)
def test_the_live_page_follows_a_rollout_without_reloading(proxy, marker, tmp_path):
    with UI(proxy.db) as ui, Browser(tmp_path / "browser") as browser:
        browser.sign_in_as(ui)
        browser.go(f"{ui.base}/-/stepmill/live?minutes=30")
        browser.wait_for("window.stepmillLiveRefreshes >= 1")
        browser.evaluate(f"window.sameDocument = {json.dumps(marker)}")  # gone if the page ever reloads
        done, steps = browser.evaluate(NUMBER.format("ok")), browser.evaluate(NUMBER.format("steps"))
        rollout = subprocess.Popen(STEPMILL + ["rollout", str(_config(tmp_path, proxy, marker, agent_command=SLOW_AGENT)),
                                               "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        try:
            assert browser.wait_for(f"{NUMBER.format('running')} >= 1", timeout=60)
            running = browser.evaluate("document.getElementById('sm-live-running').textContent")
            assert f"arith-{marker}-t" in running
            assert "tool-loop" in browser.evaluate("document.getElementById('sm-live-agent').textContent")
            browser.wait_for(f"{NUMBER.format('steps')} > {steps}", timeout=60)
            if os.environ.get("STEPMILL_SCREENSHOTS"):  # mid-rollout: runs running, steps arriving
                browser.viewport(1400, 1000)
                browser.screenshot(Path(os.environ["STEPMILL_SCREENSHOTS"]) / "live.png", full_page=True)
            browser.wait_for(f"{NUMBER.format('ok')} >= {done + 6} && {NUMBER.format('running')} + {NUMBER.format('starting')} == 0",
                             timeout=120)
        finally:
            output = rollout.communicate(timeout=120)[0]
        assert rollout.returncode == 0, output
        assert browser.evaluate("window.sameDocument") == marker  # updated in place, never reloaded
        assert browser.evaluate(NUMBER.format("steps")) >= steps + 12  # 6 runs, 2 calls each
        assert browser.evaluate("Chart.getChart(document.getElementById('sm-live-chart')).data.datasets.length") >= 1


def test_the_live_refresh_is_one_query_read_through_indexes(tmp_path):
    store = Store(str(tmp_path / "x.db"))
    plan = [row[3] for row in store.db.conn.execute("EXPLAIN QUERY PLAN " + LIVE, {"since": "x", "minute_ago": "y"})]
    assert not [line for line in plan if line.startswith("SCAN") and line.split()[1] in ("s", "t", "c")], plan
    for index in ("idx_steps_started_at", "idx_run_credentials_created_at", "idx_trajectories_completed_at"):
        assert any(index in line for line in plan), (index, plan)


@needs_chromium
def test_the_group_page_draws_the_tree_the_bridge_packs(proxy, marker, tmp_path):
    group = f"grp {marker}/odd?#"  # every link must encode it
    client = proxy.client()
    ids = {}
    for name, reward, steps in [
        ("a", 1.0, [([1, 2, 3, 4], [5, 6]), ([1, 2, 3, 4, 5, 6, 11], [12])]),
        ("b", 0.0, [([1, 2, 3, 4], [7, 8])]),
        ("c", 0.5, [([1, 2, 9], [10])]),
    ]:
        trajectory = client.start_trajectory(trajectory_id=f"{name}-{marker}", group_id=group,
                                             metadata={"agent": f"agent-{name}"})["trajectory_id"]
        ids[name] = [client.submit_step(trajectory_id=trajectory, prompt_ids=p, response_ids=r)["step_id"]
                     for p, r in steps]
        client.complete_trajectory(trajectory, reward=reward)
    with UI(proxy.db) as ui:
        status, body, _ = ui.get(stepmill_path("groups", group, ".json"))
        assert status == 200, body
        data = json.loads(body)
        # [1 2] shared by all; [3 4] by a and b, who part at position 4; c leaves at position 2.
        assert sorted((n["depth"], n["length"]) for n in data["nodes"]) == [(0, 2), (2, 2), (2, 2), (4, 2), (4, 4)]
        assert sorted(n["head"][0] for n in data["nodes"]) == [1, 3, 5, 7, 9]
        by_head = {n["head"][0]: n for n in data["nodes"]}
        assert by_head[1]["parent"] is None and len(by_head[1]["rollouts"]) == 3
        assert by_head[3]["rollouts"] == [f"a-{marker}", f"b-{marker}"] and by_head[9]["depth"] == 2
        assert by_head[5]["depth"] == by_head[7]["depth"] == 4 and by_head[5]["length"] == 4  # 5 6 11 12
        assert by_head[5]["parent"] == by_head[7]["parent"] == by_head[3]["id"]
        assert [(s["step_id"], s["part"]) for s in by_head[5]["steps"]] == [(ids["a"][0], "response")]
        assert [(s["step_id"], s["part"]) for s in by_head[9]["steps"]] == [(ids["c"][0], "prompt")]
        assert {e["step_id"]: e["at"] for e in by_head[5]["ends"]} == {ids["a"][0]: 6, ids["a"][1]: 8}
        assert data["summary"]["packed_tokens"] == 12 and data["summary"]["original_tokens"] == 6 + 8 + 6 + 4
        advantages = {r["trajectory_id"]: r["advantage"] for r in data["rollouts"]}
        assert advantages == {f"a-{marker}": 0.5, f"b-{marker}": -0.5, f"c-{marker}": 0.0}
        with Browser(tmp_path / "browser") as browser:
            browser.sign_in_as(ui)
            browser.go(ui.base + stepmill_path("groups", group))
            nodes = browser.evaluate("[...document.querySelectorAll('[data-sm=node]')].map(n => "
                                     "[+n.dataset.depth, +n.dataset.length, +n.dataset.rollouts])")
            assert sorted(map(tuple, nodes)) == [(0, 2, 3), (2, 2, 1), (2, 2, 2), (4, 2, 1), (4, 4, 1)]
            links = browser.evaluate("[...document.querySelectorAll('[data-sm=branch-step]')]"
                                     ".map(a => a.getAttribute('href'))")
            assert stepmill_path("steps", ids["a"][0]) in links and stepmill_path("steps", ids["c"][0]) in links
            assert len(browser.evaluate("[...document.querySelectorAll('[data-sm=rollout]')].map(c => c.id)")) == 3
            browser.click("[data-sm=label-bad-1]")  # b's card: reviewed from the group page, back to it
            assert browser.evaluate("location.pathname") == stepmill_path("groups", group)
            trainable = browser.evaluate("[...document.querySelectorAll('[data-sm=trainable]')].map(t => t.textContent)")
            assert trainable[1].startswith("no (bad)") and trainable[0].startswith("yes")
            browser.click("[data-sm=trainable-2]")  # c marked untrainable
        store = proxy.store()
        assert [r["value"] for r in store.query("SELECT value FROM reviews WHERE target_id = ? ORDER BY id",
                                                [f"b-{marker}"])] == ["bad"]
        assert store.curation(f"c-{marker}")["review"]["trainable"] is False
        # the trajectory page links its group
        status, page, _ = ui.get(stepmill_path("trajectories", f"a-{marker}"))
        assert status == 200 and stepmill_path("groups", group).replace("&", "&amp;") in page
        for path in (stepmill_path("groups", group), "/-/stepmill/live"):
            status, _, headers = ui.get(path, anonymous=True)
            assert (status, headers["location"]) == (302, "/-/stepmill/sign-in"), path
        for path in (stepmill_path("groups", group, ".json"), "/-/stepmill/live.json"):
            assert ui.get(path, anonymous=True)[0] == 403, path


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dashboard") / "demo"
    # Not through the session's test proxy (its fixture sets these): the demo starts its own.
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("https_proxy", "http_proxy", "ssl_cert_file")}
    done = subprocess.run(STEPMILL + ["demo", "--tasks", "3", "-n", "2", "--no-ui", "--dir", str(folder)],
                          check=False, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return folder / "stepmill.db"


@needs_chromium
@pytest.mark.timeout(300)
def test_the_charts_draw_a_demo_run_and_tool_results_sit_by_their_calls(demo_db, tmp_path):
    shots = Path(os.environ["STEPMILL_SCREENSHOTS"]) if os.environ.get("STEPMILL_SCREENSHOTS") else None
    store = Store(str(demo_db), readonly=True)
    tool_run = store.query("SELECT trajectory_id AS t, group_id AS g FROM steps WHERE completion LIKE '%tool_calls%' "
                           "AND trajectory_id LIKE '%tool-loop%' ORDER BY trajectory_id LIMIT 1")[0]
    mixed = store.query("SELECT group_id AS g FROM trajectories GROUP BY 1 HAVING min(reward) != max(reward) LIMIT 1")
    with UI(demo_db) as ui:
        lifecycle = json.loads(ui.get("/-/stepmill/lifecycle.json")[1])
        agents = {row["key"]: row for row in lifecycle["agent"]}
        assert set(agents) == {"tool-loop", "token-loop"}  # the runner's names, not user agents
        assert agents["tool-loop"]["user_agent"].startswith("OpenAI/Python")
        assert lifecycle["gate"]["kept"] + lifecycle["gate"]["removed"] == lifecycle["overall"][0]["collected"]
        with Browser(tmp_path / "browser") as browser:
            browser.sign_in_as(ui)
            browser.viewport(1400, 1000)
            browser.go(f"{ui.base}/-/stepmill/lifecycle")
            charts = browser.evaluate("""[...document.querySelectorAll('canvas[data-sm=chart]')].map(c => {
                const chart = Chart.getChart(c);
                const pixels = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let inked = 0; for (let i = 3; i < pixels.length; i += 4) if (pixels[i]) inked++;
                return [c.id, chart ? chart.data.datasets.reduce((n, d) => n + d.data.filter(v => v !== null).length, 0)
                        : 0, inked, c.width];
            })""")
            assert [c[0] for c in charts] == ["sm-chart-steps", "sm-chart-reward", "sm-chart-length", "sm-chart-gate",
                                              "sm-chart-ratio"]
            for name, points, inked, width in charts:
                assert points > 0 and inked > 1000 and width > 100, (name, points, inked)
            groups = browser.evaluate("[...document.querySelectorAll('[data-sm=group-link]')].map(a => a.getAttribute('href'))")
            assert stepmill_path("groups", tool_run["g"]) in groups
            if shots:
                browser.screenshot(shots / "lifecycle.png", full_page=True)
            browser.go(ui.base + stepmill_path("trajectories", tool_run["t"]))
            paired = browser.evaluate("[...document.querySelectorAll('.sm-call')].map(c => "
                                      "[c.dataset.sm, !!c.querySelector('.sm-result')])")
            assert paired and all(has for _, has in paired), paired  # every call with its result beside it
            assert browser.evaluate("document.querySelectorAll('.sm-paired').length") == len(paired)
            if shots:
                browser.screenshot(shots / "trajectory.png", full_page=True)
            group = mixed[0]["g"] if mixed else tool_run["g"]
            browser.go(ui.base + stepmill_path("groups", group))
            # rollouts that scored differently differ in tokens: a shared prefix, then branches
            assert browser.evaluate("document.querySelectorAll('[data-sm=node]').length") >= (3 if mixed else 1)
            if shots:
                browser.screenshot(shots / "group.png", full_page=True)
