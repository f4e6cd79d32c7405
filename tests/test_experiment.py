"""`stepmill experiment`, without an engine: the experiments file and the cells it names, each cell's
rollout file as the runner and the trainer read it, the intervals over seeds, the report from finished
results, and what a later invocation skips. The run itself on the real vLLM: tests/test_experiment_run.py."""

import json
import math
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepmill.errors import ConfigError
from stepmill.experiment import catalog, cell, report, spec, stats

from .conftest import STEPMILL

EXAMPLE = Path(__file__).parent.parent / "stepmill" / "data" / "experiments.example.toml"
CI = EXAMPLE.with_name("experiments.ci.toml")


def test_the_example_varies_each_factor_around_the_default():
    experiment = spec.load(EXAMPLE)
    names = [c.name for c in experiment.cells()]
    assert names[0] == "animals16-grpo-black-box" and len(names) == len(set(names)) == 1 + 3 + 3 + 2
    assert {c.method for c in experiment.cells()} == {"grpo", "dr_grpo", "rloo", "reinforce_pp"}
    assert {c.dataset for c in experiment.cells()} == set(catalog.DATASETS)
    assert {c.runtime for c in experiment.cells()} == {"black-box", "white-box", "aider"}
    # every cell differs from the default in one factor at most
    assert all(sum(getattr(c, f) != getattr(experiment.default, f) for f in spec.FACTORS) <= 1 for c in experiment.cells())
    assert experiment.seeds == [0, 1, 2, 3, 4] and len(spec.load(CI).cells()) == 1


@pytest.mark.parametrize("data,message", [
    ({"default": {"dataset": "animals16", "method": "grpo"}}, r"\[default\] names exactly"),
    ({"default": {"dataset": "planets", "method": "grpo", "runtime": "black-box"}}, "dataset 'planets'"),
    ({"default": {"dataset": "animals16", "method": "ppo", "runtime": "black-box"}}, "method 'ppo'"),
    ({"default": {"dataset": "animals16", "method": "grpo", "runtime": "emacs"}}, "runtime 'emacs'"),
    ({"vary": {"layout": ["tree"]}}, r"\[vary\]: the factors"),
    ({"vary": {"method": "rloo"}}, r"\[vary\] method: a list"),
    ({"seeds": []}, "seeds"), ({"seeds": [0, 0]}, "each seed once"), ({"seeds": [True]}, "seeds"),
    ({"iterations": 0}, "iterations"), ({"lr": "fast"}, "lr"), ({"itterations": 3}, "unknown key"),
])
def test_a_wrong_file_is_refused_naming_what_is_wrong(data, message):
    default = {"default": {"dataset": "animals16", "method": "grpo", "runtime": "black-box"}}
    with pytest.raises(ConfigError, match=message):
        spec.parse({**default, **data}, "x")


@pytest.mark.parametrize("runtime", ["black-box", "white-box", "aider"])
@pytest.mark.parametrize("dataset", list(catalog.DATASETS))
def test_each_cells_rollout_file_is_read_by_the_runner_and_the_trainer(tmp_path, dataset, runtime):
    from stepmill.rewards.scoring import reward_specs
    from stepmill.runner.config import load
    from stepmill.train.config import load_train

    if runtime == "aider" and catalog._program("aider") is None:
        pytest.skip("aider is not installed (.ci/install-agents installs it)")
    the_cell = spec.Cell(dataset, "rloo", runtime)
    (tmp_path / "tasks.jsonl").write_text(catalog.tasks_text(dataset, 3))
    (tmp_path / "model").mkdir()
    path = tmp_path / "rollout.toml"
    settings = spec.parse({"default": the_cell.__dict__}, "x").settings
    path.write_text(cell.rollout_toml(the_cell, 7, settings, base_url="http://127.0.0.1:9/v1", model="m",
                                      model_dir=tmp_path / "model"))
    config = load(path)
    train = load_train(config)  # the file parsed once, as `stepmill train` does
    assert config.run.dataset == dataset and config.run.n == 4 and len(config.tasks(dataset)) == 3
    assert train.method == "rloo" and train.seed == 7 and train.iterations == 10 and train.control
    assert config.run.max_new_tokens == catalog.CALL_TOKENS  # an agent CLI's calls may add what the others' may
    [reward] = reward_specs(config.tables, path, other_sections=True)  # as each round scores it
    assert f"{reward.function.__module__}:{reward.function.__name__}" == catalog.DATASETS[dataset].reward
    task = json.loads(catalog.tasks_text(dataset, 1))  # the task's fields are its trajectory's metadata
    assert reward.function({"metadata": task, "completion": {"content": "cat table"}})[0] > 0


def test_every_runtimes_calls_may_add_the_same(monkeypatch, tmp_path):
    """The white-box reply's cap and the engine's default (the tool loop names none) are the CLIs' cap."""
    import inspect

    from stepmill.agents import reply_once
    from stepmill.demo import main as demo
    from stepmill.experiment import command

    assert inspect.signature(reply_once.run).parameters["max_tokens"].default == catalog.CALL_TOKENS
    started = {}
    monkeypatch.setattr(demo, "vllm_python", lambda: "python")
    monkeypatch.setattr(demo, "start_vllm", lambda folder, **options: started.update(options))
    command.start_engine(tmp_path)
    assert started["max_new_tokens"] == catalog.CALL_TOKENS


def test_the_t_quantile():
    assert stats.t_975(1) == 12.706 and stats.t_975(2) == 4.303 and stats.t_975(22) == 2.086  # 20's: wider
    assert stats.t_975(1000) == 1.960
    with pytest.raises(ValueError):
        stats.t_975(0)
    mean, half = stats.interval([0.1, 0.2, 0.3])
    assert math.isclose(mean, 0.2) and math.isclose(half, 4.303 * 0.1 / math.sqrt(3))
    assert stats.interval([0.5]) == (0.5, None) and stats.interval([None]) == (None, None)


@given(st.lists(st.floats(-1, 1, allow_nan=False), min_size=2, max_size=12))
def test_an_interval_holds_its_mean_and_shrinks_with_agreement(values):
    mean, half = stats.interval(values)
    assert min(values) - 1e-9 <= mean <= max(values) + 1e-9 and half >= 0
    assert stats.interval([values[0]] * len(values))[1] == pytest.approx(0, abs=1e-12)


def result(name: str, seed: int, rewards: list, control: list, **extra) -> dict:
    """A finished run's result as cell.run_cell writes it: one row per version."""
    rows = [{"version": v, "reward": r, "rollout_s": 2.0, "train_s": 1.0, "sync_s": 0.5, "tokens": 100.0,
             "rollout_gap": 1e-6 * (v + 1)} for v, r in enumerate(rewards)]
    del rows[-1]["train_s"]  # the last version is measured, not trained
    return {"cell": name, "seed": seed, "wall_s": 100.0, "started": "2026-01-01T00:00:00Z", "command": f"cmd {seed}",
            "machine": {"cores": 2}, "run": rows, "control": [{"version": v, "reward": r} for v, r in enumerate(control)],
            "control_from": None, **extra}


def test_a_cells_numbers_over_its_seeds():
    results = [result("c", s, [0.1, 0.2, 0.3, 0.4, 0.5], [0.1, 0.1, 0.1, 0.1, 0.1 + s / 100]) for s in range(3)]
    numbers = stats.cell_numbers(results)
    assert numbers["seeds"] == 3 and numbers["reward_v0"] == (pytest.approx(0.1), pytest.approx(0))
    assert numbers["last3"][0] == pytest.approx(0.4)
    margins = [0.4 - (0.1 + 0.1 + 0.1 + s / 100) / 3 for s in range(3)]
    assert numbers["margin"][0] == pytest.approx(sum(margins) / 3)
    assert numbers["margin"][1] == pytest.approx(stats.interval(margins)[1])
    assert numbers["s_per_version"] == pytest.approx(3.5) and numbers["tokens_per_s"] == pytest.approx(100.0)
    assert numbers["rollout_gap"] == pytest.approx(5e-6) and numbers["wall_s"] == 300.0


def write_results(folder: Path, results: list[dict]) -> None:
    for r in results:
        path = folder / "results" / r["cell"] / f"seed-{r['seed']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))


def test_the_report_has_a_row_a_plot_and_the_commands_of_each_cell(tmp_path):
    write_results(tmp_path, [result("animals16-grpo-black-box", s, [0.2, 0.25, 0.3, 0.3], [0.2, 0.2, 0.2, 0.21])
                             for s in (0, 1)] + [result("animals16-rloo-black-box", 0, [0.2, 0.2, 0.2, 0.2], [0.2] * 4,
                                                        control_from="animals16-grpo-black-box")])
    path = report.write_report(tmp_path, order=["animals16-grpo-black-box"], title="t")
    text = path.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows[0].startswith("| `animals16-grpo-black-box` | 2 | 0.200 ± 0.000 | 0.283 ± 0.000 |")
    assert "+0.080 ± 0.000" in rows[0] and rows[1].startswith("| `animals16-rloo-black-box` | 1 |")
    assert "`cmd 0`" in text and "`cmd 1`" in text and "its control that of `animals16-grpo-black-box`" in text
    for name in ("animals16-grpo-black-box", "animals16-rloo-black-box"):
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_finished_run_is_skipped_and_its_control_shared_by_the_other_methods(tmp_path):
    experiment = spec.load(EXAMPLE)
    default = experiment.default
    write_results(tmp_path, [result(default.name, 1, [0.2] * 3, [0.2] * 3)])
    listed = subprocess.run(STEPMILL + ["experiment", str(EXAMPLE), "--folder", str(tmp_path), "--list",
                                        "--cell", default.name], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [f"{default.name} seed 0: to run", f"{default.name} seed 1: done (100 s)",
                                          f"{default.name} seed 2: to run", f"{default.name} seed 3: to run",
                                          f"{default.name} seed 4: to run"]
    rloo = spec.Cell(default.dataset, "rloo", default.runtime)
    assert cell.shared_control(tmp_path, experiment, rloo, 1)["cell"] == default.name
    assert cell.shared_control(tmp_path, experiment, rloo, 0) is None
    assert cell.shared_control(tmp_path, experiment, spec.Cell("words8", "grpo", default.runtime), 1) is None
    reported = subprocess.run(STEPMILL + ["experiment", str(EXAMPLE), "--folder", str(tmp_path), "--report"],
                              capture_output=True, text=True)
    assert reported.returncode == 0 and "1 of 45 runs finished, 0 to run" in reported.stderr, reported.stderr
    assert f"| `{default.name}` | 1 |" in (tmp_path / "report.md").read_text()


def test_an_unknown_cell_or_seed_is_refused():
    for option, value, message in (("--cell", "nope", "no cell named nope"), ("--seed", "9", r"seed\(s\) \[9\]")):
        done = subprocess.run(STEPMILL + ["experiment", str(EXAMPLE), option, value, "--list"], capture_output=True,
                              text=True)
        assert done.returncode == 1 and message.replace("\\", "") in done.stderr.replace("\\", ""), done.stderr


def test_the_training_demo_runs_the_default_cell_and_says_if_its_margin_excludes_zero():
    from stepmill.experiment.training_demo import default_cell, margin_verdict

    shipped = spec.load(EXAMPLE)
    experiment, demo_cell = default_cell(tasks=None, n=None, iterations=3, concurrency=None)
    assert demo_cell == shipped.default
    assert experiment.settings == {**shipped.settings, "iterations": 3}
    one = [result("c", 0, [0.1, 0.2, 0.3, 0.4], [0.1] * 4)]
    assert margin_verdict(one) == "margin over the control +0.200 (one seed: run more seeds for an interval)"
    apart = [result("c", s, [0.1, 0.2, 0.3, 0.4 + s / 100], [0.1] * 4) for s in range(3)]
    assert margin_verdict(apart).endswith("excludes zero: learning")
    noisy = [result("c", s, [0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, r]) for s, r in enumerate((0.0, 0.2, 0.05))]
    assert margin_verdict(noisy).endswith("reaches zero: not distinguishable from noise")
    assert "margin +0.200" in stats.seed_line(one[0]) and "last 3 versions: reward 0.3000" in stats.seed_table(one[0])


def test_the_training_demo_needs_the_real_engine():
    done = subprocess.run(STEPMILL + ["demo", "--train", "--seed", "1"], capture_output=True, text=True)
    assert done.returncode != 0 and "--train closes the loop on the real engine: add --engine vllm" in done.stderr
