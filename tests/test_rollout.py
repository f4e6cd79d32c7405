"""`stepmill rollout`: the shipped black-box agent, n runs per task through the real proxy; tags,
a failing agent, timeouts, resume, and configuration errors with their line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import STEPMILL
from .rollout_files import write_rollout


def _config(tmp_path, proxy, marker, *, agent_command=None, timeout=60, extra=""):
    tasks = [{"id": f"t{i}", "prompt": f"What is {i} + {i}? ({marker})", "answer": str(2 * i)} for i in range(3)]
    command = agent_command or [sys.executable, "-m", "stepmill.agents.tool_loop", "--model", "{model}"]
    run_extra, _, isolation_extra = extra.partition("[isolation]")  # its lines join the one [isolation] table
    # The test upstream stands for api.openai.com (tests/redirect_hosts.py sends the calls there), and a run's
    # door judges where its connections really go.
    return write_rollout(tmp_path, proxy, dataset=f"arith-{marker}", command=command, tasks=tasks, agent="tool-loop",
                         env={"OPENAI_API_KEY": "sk-local"},
                         isolation=f'allow_hosts = ["127.0.0.1:{proxy.upstream.port}"]\n{isolation_extra}',
                         run=f'n = 2\nconcurrency = 3\ntimeout = {timeout}\nmodel = "gpt-test"\n{run_extra}',
                         more=f'[[reward]]\nname = "math-{marker}"\nfunction = "stepmill.rewards.functions:math_answer"\n')


def _rollout(config):
    return subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow  # a whole rollout: about 17 s
def test_the_tool_loop_agent_through_the_runner(proxy, marker, tmp_path):
    config = _config(tmp_path, proxy, marker)
    done = _rollout(config)
    assert done.returncode == 0, done.stderr
    assert "6 runs finished (0 failed, 0 timed out), 0 done earlier, of 6" in done.stderr
    assert f"reward math-{marker}: scored 6" in done.stderr
    store = proxy.store()
    trajectories = store.query("SELECT * FROM trajectories WHERE id LIKE ? ORDER BY id", [f"arith-{marker}-%"])
    assert [t["id"] for t in trajectories] == [f"arith-{marker}-t{i}-{k}" for i in range(3) for k in range(2)]
    assert {t["status"] for t in trajectories} == {"complete"}
    assert {t["group_id"] for t in trajectories} == {f"arith-{marker}-t{i}" for i in range(3)}
    metadata = json.loads(trajectories[0]["metadata"])
    assert metadata["exit_status"] == 0 and metadata["outcome"] == "ok" and metadata["isolation"] == "sandbox"
    # The answer is for scoring only: kept apart from the metadata every reader sees.
    assert "answer" not in metadata and store.scoring_fields(trajectories[0]["id"]) == {"answer": "0"}
    steps = proxy.steps("s.trajectory_id LIKE ?", [f"arith-{marker}-%"], count=12)
    by_trajectory = {}
    for step in steps:
        by_trajectory.setdefault(step["trajectory_id"], []).append(step)
    assert len(by_trajectory) == 6 and all(len(s) == 2 for s in by_trajectory.values())  # tool call, then answer
    assert store.query("SELECT count(*) AS n FROM rewards WHERE name = ?", [f"math-{marker}"])[0]["n"] == 6
    again = _rollout(config)  # resume: everything finished, nothing runs again
    assert "0 runs finished (0 failed, 0 timed out), 6 done earlier, of 6" in again.stderr


def test_failing_and_slow_agents_are_recorded(proxy, marker, tmp_path):
    failing = _config(tmp_path, proxy, marker, agent_command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    done = _rollout(failing)
    assert "6 runs finished (6 failed, 0 timed out)" in done.stderr
    row = proxy.store().query("SELECT metadata, status FROM trajectories WHERE id = ?", [f"arith-{marker}-t0-0"])[0]
    assert row["status"] == "complete" and json.loads(row["metadata"])["exit_status"] == 3

    slow_dir = tmp_path / "slow"
    slow_dir.mkdir()
    slow = _config(slow_dir, proxy, f"{marker}s", agent_command=[sys.executable, "-c", "import time; time.sleep(30)"],
                   timeout=1)
    done = _rollout(slow)
    assert "6 runs finished (0 failed, 6 timed out)" in done.stderr
    meta = json.loads(proxy.store().query("SELECT metadata FROM trajectories WHERE id = ?",
                                          [f"arith-{marker}s-t1-1"])[0]["metadata"])
    assert meta["outcome"] == "timeout" and meta["duration_s"] < 10


@pytest.mark.parametrize("mistake,message", [
    ('[run]\nagent = "tool-loop"\ndataset = "x"\nnn = 4\n', ":{line}: run.nn: unknown key"),
    ('[run]\nagent = "nobody"\ndataset = "x"\n', ":{line}: run.agent: no [[agent]] named 'nobody'"),
    ('[run]\nagent = "tool-loop"\ndataset = "x"\nn = 0\n', ":{line}: run.n: a positive integer is required"),
    ('[run]\nagent = "tool-loop"\ndataset = "x"\n[isolation]\nmode = "jail"\n',
     ":{line}: isolation.mode: must be one of auto, sandbox, user, container, none"),
    ('[run]\nagent = "tool-loop"\ndataset = "x"\n[isolation]\nmode = "container"\nprefix = []\n',
     ":{line}: isolation.prefix: a non-empty list of strings is required"),
])
def test_configuration_errors_name_the_key_and_line(tmp_path, mistake, message):
    text = ('[[agent]]\nname = "tool-loop"\ncommand = ["true"]\n\n[[dataset]]\nname = "x"\npath = "t.jsonl"\n\n'
            + mistake)
    config = tmp_path / "bad.toml"
    config.write_text(text)
    key = message.split(": ")[1].split(".")[1]
    line = next(i for i, content in enumerate(text.splitlines(), start=1) if content.startswith(f"{key} ="))
    done = subprocess.run(STEPMILL + ["rollout", str(config)], capture_output=True, text=True)
    assert done.returncode != 0 and message.format(line=line) in done.stderr, done.stderr


def _unrevoked(store, marker) -> list[str]:
    """The rollout's runs whose latest registration still holds a working secret."""
    return [row["trajectory_id"] for row in store.query(
        "SELECT trajectory_id, revoked_at FROM run_credentials WHERE rowid IN (SELECT max(rowid) FROM run_credentials"
        " GROUP BY trajectory_id) AND trajectory_id LIKE ?", [f"arith-{marker}-%"]) if row["revoked_at"] is None]


def test_ctrl_c_keeps_what_ran_and_the_next_run_resumes(proxy, openai_client, marker, tmp_path):
    import signal
    import time

    slow = _config(tmp_path, proxy, marker, agent_command=[sys.executable, "-c", "import time; time.sleep(60)"])
    process = subprocess.Popen(STEPMILL + ["rollout", str(slow), "--no-progress"], stderr=subprocess.PIPE, text=True)
    store = proxy.store()
    deadline = time.time() + 30
    while store.query("SELECT count(*) AS n FROM trajectories WHERE id LIKE ?", [f"arith-{marker}-%"])[0]["n"] < 3:
        assert time.time() < deadline, "no run started"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)  # every thread's stack, for the failure below
        time.sleep(2)
        process.kill()
        pytest.fail(f"the runner did not end within 60 s of Ctrl-C:\n{process.communicate()[1][-6000:]}")
    quick = _config(tmp_path, proxy, marker, agent_command=[sys.executable, "-c", "print('done')"])
    try:
        assert process.returncode == 130 and "run the same command again to resume" in stderr, stderr
        assert "did not stop" not in stderr, stderr  # every run stopped when told
        statuses = {r["status"] for r in
                    store.query("SELECT status FROM trajectories WHERE id LIKE ?", [f"arith-{marker}-%"])}
        assert statuses == {"open"}
        # Every run's secret was revoked, those never started too: no open door fences the proxy now.
        assert _unrevoked(store, marker) == []
        openai_client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": marker}])
    finally:  # the runs registered above end here whatever failed: open ones fence the shared proxy
        done = _rollout(quick)
    assert "6 runs finished (0 failed, 0 timed out), 0 done earlier, of 6" in done.stderr


def test_ctrl_c_while_the_runs_threads_start_stops_cleanly():
    """Ctrl-C between two threads' starts (the CI machine, loaded, once got it there): the rollout still
    ends as interrupted, not with "cannot join thread before it is started" and status 1."""
    import threading
    from types import SimpleNamespace

    from stepmill.runner.rollout import Workers

    release, taken = threading.Event(), []
    jobs = [SimpleNamespace(trajectory=f"t{i}") for i in range(6)]
    workers = Workers(lambda job: (taken.append(job.trajectory), release.wait(10)), jobs, 3)

    def interrupted():
        raise KeyboardInterrupt

    workers.threads[1].start = interrupted
    with pytest.raises(KeyboardInterrupt):
        workers.run()
    workers.cancel()
    release.set()
    workers.wait(5)  # raised RuntimeError before
    assert not workers.threads[0].is_alive() and taken in ([], ["t0"])  # t0 may see the cancel first


def test_ctrl_c_in_the_middle_of_a_registration_gives_that_secret_back_too(proxy, openai_client, marker, tmp_path,
                                                                           monkeypatch):
    """The proxy registered the run but Ctrl-C came before its answer did: that run's secret is revoked
    with the others, or its open door would fence the proxy for every later caller."""
    from stepmill.runner import rollout as rollout_module
    from stepmill.runner.config import load

    real, registered = rollout_module.register, []

    def cut_short(*args):
        registered.append(real(*args))
        if len(registered) == 3:
            raise KeyboardInterrupt  # registered, the answer never kept
        return registered[-1]

    monkeypatch.setattr(rollout_module, "register", cut_short)
    config = _config(tmp_path, proxy, marker, agent_command=[sys.executable, "-c", "print('done')"])
    with pytest.raises(KeyboardInterrupt):
        rollout_module.rollout(load(str(config)), progress=False)
    try:
        assert len(registered) == 3 and _unrevoked(proxy.store(), marker) == []
        openai_client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": marker}])
    finally:  # the runs end here whatever failed: open ones fence the shared proxy
        done = _rollout(config)
    assert "6 runs finished (0 failed, 0 timed out), 0 done earlier, of 6" in done.stderr


def test_a_run_taken_just_before_ctrl_c_has_its_secret_revoked(proxy, marker, tmp_path, monkeypatch):
    """A run thread that took its job just before Ctrl-C finds the site stopped and never starts the run
    (nor revokes its secret itself): the rollout's way out revokes it."""
    import signal
    import threading

    from stepmill.runner import rollout as rollout_module
    from stepmill.runner.config import load

    real, fired = rollout_module.run_one, threading.Event()

    def taken_late(site, job, admission):
        if not fired.is_set():
            fired.set()
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # Ctrl-C, as the terminal sends it
        site.stop.wait(10)
        return real(site, job, admission)  # stopped: returns at once

    monkeypatch.setattr(rollout_module, "run_one", taken_late)
    config = _config(tmp_path, proxy, marker, agent_command=[sys.executable, "-c", "print('done')"])
    # Ctrl-C is KeyboardInterrupt even where the suite was started with SIGINT ignored (a background job)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            rollout_module.rollout(load(str(config)), progress=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert _unrevoked(proxy.store(), marker) == []
    finally:  # the runs end here whatever failed: open ones fence the shared proxy
        done = _rollout(config)
    assert "6 runs finished (0 failed, 0 timed out), 0 done earlier, of 6" in done.stderr


def test_a_signal_another_thread_takes_still_stops_the_rollout():
    """The kernel may hand a process's Ctrl-C to any thread that does not block it; Python runs the
    handler only in the main thread, once it runs Python again. Waiting on the runs' threads never
    blocks for good, so the interrupt lands within a fraction of a second, not when the runs end."""
    import signal
    import threading
    import time
    from types import SimpleNamespace

    from stepmill.runner.rollout import Workers

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    release = threading.Event()
    workers = Workers(lambda job: release.wait(20), [SimpleNamespace(trajectory="t")], 1)
    taker = threading.Thread(target=lambda: (time.sleep(0.3), signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)))
    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        started = time.monotonic()
        with pytest.raises(Interrupted):
            taker.start()
            workers.run()
        assert time.monotonic() - started < 5  # 20 s (the run's own end) before
    finally:
        release.set()
        taker.join()
        signal.signal(signal.SIGUSR2, previous)


def _sim_config(tmp_path, proxy, simulated_llm, marker, *, agents, extra_route="", proxy_section=True, n=4,
                tasks=3, prefix="sim", model="qwen-sim", timeout=120):
    """Both shipped agents on the bundled tasks against an engine (``simulated_llm``: anything with a
    ``url``, the real vLLM too), scored by the math reward."""
    import importlib.resources

    bundled = (importlib.resources.files("stepmill") / "data" / "arith20.jsonl").read_text().splitlines()
    (tmp_path / "tasks.jsonl").write_text("\n".join(bundled[:tasks]) + "\n")
    config = tmp_path / "rollout.toml"
    proxy_block = f'[proxy]\nurl = "{proxy.url}"\ndb = "{proxy.db}"\nconfdir = "{proxy.confdir}"\n' if proxy_section \
        else f'[proxy]\ndb = "{tmp_path / "own.db"}"\nconfdir = "{tmp_path / "mitm"}"\n'
    config.write_text(f"""{proxy_block}
[route]
base_url = "{simulated_llm.url}"
{extra_route}

[[agent]]
name = "tool-loop"
command = ["{{python}}", "-m", "stepmill.agents.tool_loop", "--model", "{{model}}"]
env = {{ OPENAI_API_KEY = "sk-local" }}

[[agent]]
name = "token-loop"
entry = "stepmill.agents.token_loop:run"

[[dataset]]
name = "{prefix}-{marker}"
path = "tasks.jsonl"

[run]
agent = {json.dumps(agents)}
dataset = "{prefix}-{marker}"
n = {n}
concurrency = 4
timeout = {timeout}
model = "{model}"
policy_version = "{marker}"

[[reward]]
name = "math-{marker}"
function = "stepmill.rewards.functions:math_answer"
""")
    return config


@pytest.mark.slow  # both shipped agents' rollouts: about 40 s
@pytest.mark.timeout(300)
def test_both_shipped_agents_against_the_simulated_llm(proxy, simulated_llm, marker, tmp_path):
    """Three tasks × two agents × n=4: the black-box loop through the proxy, the white-box loop token
    in / token out with its steps submitted by the runner; both with exact Qwen2 ids, grouped, scored."""
    config = _sim_config(tmp_path, proxy, simulated_llm, marker, agents=["tool-loop", "token-loop"])
    done = _rollout(config)
    assert done.returncode == 0, done.stderr
    assert "24 runs finished (0 failed, 0 timed out)" in done.stderr and f"reward math-{marker}: scored 24" in done.stderr
    store = proxy.store()
    trajectories = store.query("SELECT * FROM trajectories WHERE id LIKE ?", [f"sim-{marker}-%"])
    assert len(trajectories) == 24 and {t["status"] for t in trajectories} == {"complete"}
    groups = {}
    for t in trajectories:
        groups.setdefault(t["group_id"], []).append(t)
    assert sorted(groups) == sorted(f"sim-{marker}-t0{i}-{agent}" for i in (1, 2, 3)
                                    for agent in ("tool-loop", "token-loop"))
    assert all(len(members) == 4 for members in groups.values())
    assert {t["reward"] for t in trajectories} <= {0.0, 1.0} and all(t["reward"] is not None for t in trajectories)
    steps = proxy.steps("s.trajectory_id LIKE ?", [f"sim-{marker}-%"], count=24)
    assert {s["token_provenance"] for s in steps} == {"exact"}
    assert {s["policy_version"] for s in steps} == {marker}
    by_agent = {"tool-loop": [], "token-loop": []}
    for step in steps:
        by_agent["token-loop" if "-token-loop-" in step["trajectory_id"] else "tool-loop"].append(step)
    assert {s["api"] for s in by_agent["tool-loop"]} == {"openai.chat"}
    assert {s["api"] for s in by_agent["token-loop"]} == {"control"}
    consistency = store.query("SELECT DISTINCT consistency FROM steps WHERE trajectory_id LIKE ?", [f"sim-{marker}-%"])
    assert {r["consistency"] for r in consistency} <= {"root", "consistent"}
    # The white-box trajectory is one token sequence: each prompt extends the previous prompt + response.
    white = {}
    for step in by_agent["token-loop"]:
        white.setdefault(step["trajectory_id"], []).append(step)
    for chain in white.values():
        chain.sort(key=lambda s: s["step_index"])
        for before, after in zip(chain, chain[1:]):
            assert after["prompt_ids"][:len(before["prompt_ids"]) + len(before["response_ids"])] == \
                before["prompt_ids"] + before["response_ids"]
            assert after["parent_step_id"] == before["step_id"]
    metadata = json.loads(trajectories[0]["metadata"])
    assert metadata["outcome"] == "ok" and "answer" not in metadata


def test_a_white_box_step_carries_the_version_the_engine_names(proxy, simulated_llm, marker, tmp_path):
    """Where the engine names the weights that sampled each token (vLLM's token route), a white-box step
    is stamped with that version, not by the clock: a call in flight across a weight sync in async
    training says which policy sampled it."""
    import urllib.request

    from stepmill.runner.agent_run import engine_versions

    def label(version):
        request = urllib.request.Request(simulated_llm.url.removesuffix("/v1") + "/update_weight_version",
                                         data=json.dumps({"new_version": version}).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).read()

    config = _sim_config(tmp_path, proxy, simulated_llm, marker, agents=["token-loop"], n=2, tasks=1)
    label(f"engine-{marker}")
    try:
        done = _rollout(config)
    finally:
        label("default")  # the shared engine back as it was: unlabelled
    assert "2 runs finished (0 failed, 0 timed out)" in done.stderr, done.stderr
    steps = proxy.steps("s.trajectory_id LIKE ?", [f"sim-{marker}-%"], count=2)
    assert {s["policy_version"] for s in steps} == {f"engine-{marker}"}  # not the run's marker
    assert {(s["metadata"] if isinstance(s["metadata"], dict) else json.loads(s["metadata"]))["version_from"]
            for s in steps} == {"engine"}
    tags = {"metadata": {"agent": "a"}}
    # a sync inside the generation: the first token's version, and every span kept
    spans = [{"version": "3", "start": 0, "end": 5}, {"version": "4", "start": 5, "end": 9}]
    assert engine_versions({"weight_versions": spans}, tags) == {
        "policy_version": "3", "metadata": {"agent": "a", "version_from": "engine", "weight_versions": spans}}
    # an engine never labelled, or no word at all: the clock decides
    assert engine_versions({"weight_versions": [{"version": "default", "start": 0, "end": 2}]}, tags) == {}
    assert engine_versions({"weight_versions": "3"}, tags) == engine_versions({}, tags) == {}


def test_no_agent_gets_the_write_token(proxy, simulated_llm, marker, tmp_path):
    config = _sim_config(tmp_path, proxy, simulated_llm, marker, agents=["tool-loop"], n=1, tasks=1)
    text = config.read_text().replace(
        'command = ["{python}", "-m", "stepmill.agents.tool_loop", "--model", "{model}"]',
        'command = ["{python}", "-c", "import os, sys; sys.exit(3 if \'STEPMILL_TOKEN\' in os.environ else 0)"]')
    config.write_text(text)
    import os

    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "STEPMILL_TOKEN": proxy.token})
    assert "1 runs finished (0 failed, 0 timed out)" in done.stderr, done.stderr


@pytest.mark.slow  # rollouts through the reverse route: about 30 s
def test_reverse_route_tags_a_base_url(tmp_path, proxy, simulated_llm, marker):
    """route.reverse: the runner's own proxy gets a reverse mode; agents get .../t/<trajectory>/g/<group>/v1."""
    config = _sim_config(tmp_path, proxy, simulated_llm, marker, agents=["tool-loop"], n=2, tasks=1,
                         extra_route="reverse = true", proxy_section=False)
    text = config.read_text().replace('"--model", "{model}"]', '"--model", "{model}"]\ninput = "stdin"')
    config.write_text(text)
    done = _rollout(config)
    assert "2 runs finished (0 failed, 0 timed out)" in done.stderr, done.stderr
    from stepmill.store import Store

    store = Store(str(tmp_path / "own.db"), readonly=True)
    rows = store.query("SELECT trajectory_id, group_id, path, token_provenance FROM steps")
    assert rows and {r["group_id"] for r in rows} == {f"sim-{marker}-t01"}
    assert {r["trajectory_id"] for r in rows} == {f"sim-{marker}-t01-0", f"sim-{marker}-t01-1"}
    assert {r["path"] for r in rows} == {"/v1/chat/completions"} and {r["token_provenance"] for r in rows} == {"exact"}


@pytest.mark.parametrize("agent,route,message", [
    ('name = "a"\ncommand = ["true"]\nentry = "m:f"', "", "agent: 'a': give either command (black-box) or entry"),
    ('name = "a"\nentry = "not an entry"', '[route]\nbase_url = "http://x/v1"\n', "agent.entry: 'module:function'"),
    ('name = "a"\nentry = "m:f"', "", "white-box agents need route.base_url"),
    ('name = "a"\ncommand = ["true"]', '[route]\nbase_url = "ftp://x"\n', "route.base_url: an http:// or https:// URL"),
])
def test_agent_and_route_errors(tmp_path, agent, route, message):
    config = tmp_path / "bad.toml"
    config.write_text(f'{route}[[agent]]\n{agent}\n\n[[dataset]]\nname = "x"\npath = "t.jsonl"\n\n'
                      '[run]\nagent = "a"\ndataset = "x"\n')
    done = subprocess.run(STEPMILL + ["rollout", str(config)], capture_output=True, text=True)
    assert done.returncode != 0 and message in done.stderr, done.stderr


def test_parquet_datasets_and_bundled_ones(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stepmill.runner.config import load

    pq.write_table(pa.table({"prompt": ["What is 1 + 1?", "What is 2 + 2?"], "answer": ["2", "4"]}),
                   tmp_path / "tasks.parquet")
    config = tmp_path / "r.toml"
    config.write_text('[[agent]]\nname = "a"\ncommand = ["true"]\n\n[[dataset]]\nname = "p"\npath = "tasks.parquet"\n\n'
                      '[[dataset]]\nname = "b"\npath = "stepmill:arith20"\n\n[run]\nagent = "a"\ndataset = "p"\n')
    loaded = load(config)
    assert [(t["id"], t["prompt"], t["answer"]) for t in loaded.tasks("p")] == [
        ("1", "What is 1 + 1?", "2"), ("2", "What is 2 + 2?", "4")]
    bundled = loaded.tasks("b")
    assert len(bundled) == 20 and bundled[0]["id"] == "t01" and bundled[0]["answer"] == "395"


@pytest.mark.timeout(300)
def test_a_white_box_run_cut_short_runs_again_cleanly(proxy, simulated_llm, marker, tmp_path):
    """Ctrl-C keeps what a white-box run submitted; the rerun labels it bad (out of the gate) and
    starts its own token sequence from a root."""
    import os
    import signal
    import time

    from .conftest import TESTS

    config = _sim_config(tmp_path, proxy, simulated_llm, marker, agents=["token-loop"], n=1, tasks=1)
    slow = config.read_text().replace('entry = "stepmill.agents.token_loop:run"',
                                      'entry = "tests.whitebox_agents:generate_then_wait"\n'
                                      f'env = {{ PYTHONPATH = "{TESTS.parent}" }}')
    config.write_text(slow)
    trajectory = f"sim-{marker}-t01-0"
    process = subprocess.Popen(STEPMILL + ["rollout", str(config), "--no-progress"], stderr=subprocess.PIPE, text=True,
                               env={**os.environ})
    store = proxy.store()
    deadline = time.time() + 60
    while not store.query("SELECT id FROM steps WHERE trajectory_id = ?", [trajectory]):
        assert time.time() < deadline and process.poll() is None, "the white-box run submitted nothing"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=60)
    [old] = store.query("SELECT id FROM steps WHERE trajectory_id = ?", [trajectory])

    config.write_text(slow.replace('entry = "tests.whitebox_agents:generate_then_wait"',
                                   'entry = "stepmill.agents.token_loop:run"'))
    done = _rollout(config)
    assert "1 runs finished (0 failed, 0 timed out)" in done.stderr, done.stderr
    steps = store.query("SELECT id, parent_step_id, step_index, consistency FROM steps WHERE trajectory_id = ? "
                        "ORDER BY rowid", [trajectory])
    assert steps[0]["id"] == old["id"] and len(steps) >= 2
    new = steps[1:]
    assert new[0]["parent_step_id"] is None and new[0]["step_index"] == 0 and new[0]["consistency"] == "root"
    assert all(s["parent_step_id"] != old["id"] for s in new)
    assert store.curation(old["id"])["review"]["label"] == "bad"
    gate = store.gate_counts("s.trajectory_id = ?", [trajectory])
    assert gate["removed"] == 1 and gate["kept"] == len(new)
    # Out as an earlier attempt whatever its label, so a late commit of the cut-short run stays out too,
    # and the reward is the rerun's: scored on the latest attempt's steps alone.
    assert gate["removed_by_reason"] == {"an earlier attempt of its run": 1}
    from stepmill.rewards.scoring import trajectory_input

    [row] = [r for r in store.completed_trajectories(id_prefix=trajectory) if r["id"] == trajectory]
    assert [s["step_id"] for s in trajectory_input(store, row)["steps"]] == [s["id"] for s in new]


def test_a_white_box_agent_gets_no_answer(proxy, simulated_llm, marker, tmp_path):
    """The task a white-box agent is handed holds its id, prompt and public fields, never the answer."""
    from .conftest import TESTS

    config = _sim_config(tmp_path, proxy, simulated_llm, marker, agents=["token-loop"], n=1, tasks=1)
    config.write_text(config.read_text().replace(
        'entry = "stepmill.agents.token_loop:run"',
        f'entry = "tests.whitebox_agents:report_task"\nenv = {{ PYTHONPATH = "{TESTS.parent}" }}'))
    done = _rollout(config)
    assert "1 runs finished (0 failed, 0 timed out)" in done.stderr, done.stderr
    row = proxy.store().query("SELECT metadata FROM trajectories WHERE id = ?", [f"sim-{marker}-t01-0"])[0]
    log = (Path(json.loads(row["metadata"])["workdir"]) / "agent.log").read_text()
    assert "task fields: ['id', 'prompt']" in log, log


def test_kill_9_of_the_runner_leaves_no_process_behind(tmp_path, proxy, simulated_llm, marker):
    """The proxy the runner started and the runs it holds stop with it, even when it is killed."""
    import signal
    import time

    config = _sim_config(tmp_path, proxy, simulated_llm, marker, agents=["tool-loop"], n=2, tasks=1,
                         proxy_section=False)
    config.write_text(config.read_text().replace(
        'command = ["{python}", "-m", "stepmill.agents.tool_loop", "--model", "{model}"]',
        'command = ["{python}", "-c", "import time; time.sleep(120)"]'))
    runner = subprocess.Popen(STEPMILL + ["rollout", str(config), "--no-progress"], stderr=subprocess.DEVNULL)

    def children() -> set[int]:
        found = set()
        for task in Path(f"/proc/{runner.pid}/task").iterdir():
            try:  # a thread of the runner's may end between the listing and the read
                found |= {int(p) for p in (task / "children").read_text().split()}
            except FileNotFoundError:
                continue
        return found

    deadline = time.time() + 60
    while len(children()) < 3:  # the proxy and two runs
        assert time.time() < deadline and runner.poll() is None, "the runner did not start its proxy and runs"
        time.sleep(0.2)
    started = children()
    runner.send_signal(signal.SIGKILL)
    runner.wait(10)

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 30
    while any(alive(pid) for pid in started):
        assert time.time() < deadline, f"still running after the runner died: {[p for p in started if alive(p)]}"
        time.sleep(0.2)


def test_a_child_whose_parent_dies_before_its_prctl_does_not_outlive_it(tmp_path):
    """A parent killed between a child's fork and its prctl never sends the death signal; the child sees
    its parent gone and ends before it execs (the runner killed just as it started a run)."""
    import signal
    import time

    parent = subprocess.Popen([sys.executable, "-c", """
import os, subprocess, threading, time
from stepmill.children import die_with_parent
def slow():
    time.sleep(1.5)  # the parent is killed in this window
    die_with_parent()
def children():
    tasks = f"/proc/{os.getpid()}/task"
    return " ".join(open(f"{tasks}/{t}/children").read() for t in os.listdir(tasks)).split()
threading.Thread(target=lambda: subprocess.Popen(["sleep", "60"], preexec_fn=slow), daemon=True).start()
while not children():
    time.sleep(0.01)
print(children()[0], flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline().split()[0])
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)

    def alive() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 10
    while alive():
        assert time.time() < deadline, f"{Path(f'/proc/{child}/cmdline').read_bytes()!r} outlived its killed parent"
        time.sleep(0.1)


def test_a_seeded_rollout_sends_each_run_its_seed_and_a_paired_one_the_same(proxy, marker, tmp_path):
    """[run] seed: every call of a run carries a seed from the run's task and sample (the next call adds its
    turn); two rollouts with the same seed (a training run and its paired control) send the same seeds."""
    from stepmill.runner.agent_run import Job, run_seed

    config = _config(tmp_path, proxy, marker, extra="seed = 7")
    done = _rollout(config)
    assert done.returncode == 0, done.stderr
    sent = [r for r in proxy.upstream.requests if marker in json.dumps(r.get("messages", ""))]
    assert len(sent) == 12 and all("seed" in r for r in sent)
    expected = {run_seed(7, Job(None, {"id": f"t{i}"}, "", "", k)) + turn for i in range(3) for k in range(2)
                for turn in range(2)}
    assert {r["seed"] for r in sent} == expected and len(expected) == 12
    assert run_seed(7, Job(None, {"id": "t0"}, "a", "g", 0)) == run_seed(7, Job(None, {"id": "t0"}, "b", "h", 0))
    assert run_seed(8, Job(None, {"id": "t0"}, "a", "g", 0)) != run_seed(7, Job(None, {"id": "t0"}, "a", "g", 0))
