"""The CLI around the store: export, stats, ui (a real Datasette server), and mitmdump without the CLI."""

import json
import shutil
import subprocess
import sys
import urllib.parse

import pytest

from .browser import CHROMIUM, UI, Browser
from .conftest import STEPMILL, free_port, http_json, wait_until

EXPORT_FIELDS = ["step_id", "trajectory_id", "group_id", "parent_step_id", "step_index", "api", "transport", "host",
                 "model", "response_id", "messages", "tools", "completion", "finish_reason", "usage", "status",
                 "error", "ttft_ms", "duration_ms", "started_at", "channel", "policy_version", "reward"]


@pytest.fixture(scope="module")
def captured(proxy):
    """A small two-step tool conversation to look at."""
    import openai

    client = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", max_retries=0)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "ui weather check"}]
    first = client.chat.completions.create(model="gpt-ui", messages=messages, tools=[tool],
                                           extra_headers={"X-Stepmill-Trajectory": "ui-traj"}).choices[0].message
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "warm <b>and</b> dry"}]
    client.chat.completions.create(model="gpt-ui", messages=messages, tools=[tool],
                                   extra_headers={"X-Stepmill-Trajectory": "ui-traj"})
    return proxy.trajectory_steps("ui-traj", 2)


def test_export_jsonl(proxy, captured, tmp_path):
    out = tmp_path / "steps.jsonl"
    subprocess.run(STEPMILL + ["export", "--format", "jsonl", "--db", str(proxy.db), "--out", str(out),
                               "--where", "s.trajectory_id = 'ui-traj'"], check=True, capture_output=True)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["step_id"] for line in lines] == [s["step_id"] for s in captured]
    for line in lines:
        assert list(line)[: len(EXPORT_FIELDS)] == EXPORT_FIELDS
        for name in ("prompt_ids", "response_ids", "logprobs", "token_provenance"):
            assert name in line
    assert lines[1]["messages"][-1]["content"] == "warm <b>and</b> dry"


def test_stats(proxy, captured):
    text = subprocess.run(STEPMILL + ["stats", "--db", str(proxy.db)], check=True, capture_output=True, text=True).stdout
    assert "openai.chat" in text and "gpt-ui" in text and "trajectories:" in text
    data = json.loads(subprocess.run(STEPMILL + ["stats", "--db", str(proxy.db), "--json"], check=True,
                                     capture_output=True, text=True).stdout)
    assert data["by_model"]["gpt-ui"] >= 2 and data["by_status"]["ok"] >= 2
    assert data["tokens"]["input"] > 0


@pytest.fixture(scope="module")
def ui(proxy, captured):
    with UI(proxy.db) as ui:
        yield ui


def _json(ui, path):
    status, body, _ = ui.get(path)
    return status, json.loads(body)


def test_commands_refuse_a_missing_database(tmp_path):
    """Every command that works on the steps, tokenize, policy-version, reviewer and ui too, says the
    database is not there (one message, exit status 1) and leaves no empty database behind."""
    db = tmp_path / "typo.db"
    for command in (["stats"], ["export"], ["reward", "some-step", "1"], ["policy-version"],
                    ["policy-version", "v7"], ["tokenize", "--tokenizer", str(tmp_path)], ["reviewer", "ann"],
                    ["ui", "--port", str(free_port())]):
        done = subprocess.run(STEPMILL + command + ["--db", str(db)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, (command, done.stderr)
        assert done.stderr.strip() == f"Error: no stepmill database at {db}", (command, done.stderr)
        assert not db.exists(), command


def test_a_bad_where_or_tokenizer_is_one_line(tmp_path):
    """A --where SQLite refuses, in tokenize as in export, and a folder without a tokenizer: `Error: …`,
    exit status 1, no traceback."""
    from stepmill.qwen_vocab import default_folder
    from stepmill.store import Store

    db = tmp_path / "steps.db"
    Store(str(db)).close()
    empty = tmp_path / "empty"
    empty.mkdir()
    for command, said in (
            (["export", "--where", "s.nope = 1"], "Error: --where 's.nope = 1': no such column: s.nope"),
            (["tokenize", "--tokenizer", str(default_folder()), "--where", "s.nope = 1"],
             "Error: --where 's.nope = 1': no such column: s.nope"),
            (["tokenize", "--tokenizer", str(empty)], "Error: ")):
        done = subprocess.run(STEPMILL + command + ["--db", str(db)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, (command, done.stderr)
        assert "Traceback" not in done.stderr, (command, done.stderr)
        assert any(line.startswith(said) for line in done.stderr.splitlines()), (command, done.stderr)


def test_ui_answers_json_query_for_a_step(ui, captured):
    step = captured[1]
    status, data = _json(ui, f"/steps/steps.json?_shape=objects&id={step['step_id']}")
    assert status == 200 and data["rows"][0]["id"] == step["step_id"]
    assert data["rows"][0]["model"] == "gpt-ui"
    sql = urllib.parse.quote("select count(*) as n from steps where trajectory_id = 'ui-traj'")
    status, data = _json(ui, f"/steps/-/query.json?sql={sql}&_shape=objects")
    assert data["rows"][0]["n"] == 2
    status, record = _json(ui, f"/-/stepmill/steps/{step['step_id']}.json")
    assert status == 200 and record["messages"] == step["messages"]


def test_ui_facets_and_readable_views(ui, captured):
    html = ui.get("/steps/steps")[1]
    for facet in ("model", "api", "status", "channel", "trajectory_id"):
        assert f'data-column="{facet}"' in html
    page = ui.get(f"/-/stepmill/steps/{captured[1]['step_id']}")[1]
    assert "tool call" in page and "get_weather" in page and "sm-tool" in page
    assert "warm &lt;b&gt;and&lt;/b&gt; dry" in page  # content is escaped, not rendered
    trajectory = ui.get("/-/stepmill/trajectories/ui-traj")[1]
    assert trajectory.count('class="sm-step"') == 2
    status, _ = _json(ui, "/-/stepmill/steps/no-such-step.json")
    assert status == 404


@pytest.mark.skipif(not CHROMIUM, reason="Debian's chromium is not installed")
def test_step_page_in_a_headless_browser(proxy, ui, captured, tmp_path):
    link = subprocess.run(STEPMILL + ["reviewer", "browser", "--db", str(proxy.db), "--url", ui.base],
                          capture_output=True, text=True, check=True).stdout.strip()
    with Browser(tmp_path) as browser:
        browser.go(link)
        browser.go(f"{ui.base}/-/stepmill/trajectories/ui-traj")
        dom = browser.html()
        assert "Trajectory ui-traj" in dom and dom.count('class="sm-msg') >= 4
        browser.send("Emulation.setDeviceMetricsOverride", width=1200, height=1400, deviceScaleFactor=1, mobile=False)
        shot = tmp_path / "trajectory.png"
        browser.screenshot(shot)
    assert shot.exists() and shot.stat().st_size > 10_000


def test_mitmdump_loads_the_addon_without_the_cli(tmp_path, upstream):
    """The design card's promise: `mitmdump -s <addon> --set stepmill_db=...` works on its own."""
    import openai
    import ssl

    import httpx2


    script = subprocess.run(STEPMILL + ["addon-path"], capture_output=True, text=True, check=True).stdout.strip()
    mitmdump = shutil.which("mitmdump", path=str(__import__("pathlib").Path(sys.executable).parent))
    port = free_port()
    db = tmp_path / "plain.db"
    process = subprocess.Popen([mitmdump, "-s", script, "--set", f"stepmill_db={db}", "--listen-host", "127.0.0.1",
                                "--listen-port", str(port), "--set", f"confdir={tmp_path / 'mitm'}",
                                "--set", f"ssl_verify_upstream_trusted_ca={upstream.ca}"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: http_json("GET", "http://stepmill.local/v1/health", proxy=f"http://127.0.0.1:{port}")[0] == 200
                   if _port_open(port) else False, timeout=60, what="mitmdump")
        bundle = tmp_path / "mitm" / "mitmproxy-ca-cert.pem"
        client = openai.OpenAI(api_key="sk-x", base_url=f"https://localhost:{upstream.port}/v1", max_retries=0,
                               http_client=httpx2.Client(proxy=f"http://127.0.0.1:{port}",
                                                         verify=ssl.create_default_context(cafile=str(bundle))))
        client.chat.completions.create(model="plain-mitmdump", messages=[{"role": "user", "content": "hi"}])
        from stepmill.store import Store

        wait_until(lambda: Store(db).query("SELECT count(*) AS n FROM steps")[0]["n"] == 1, what="step")
        [step] = list(Store(db).iter_steps())
        assert step["model"] == "plain-mitmdump" and step["host"] == "localhost"
    finally:
        process.terminate()
        process.wait(15)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
