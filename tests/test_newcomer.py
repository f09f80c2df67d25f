"""A newcomer's path: the README's examples run as written, and the rough edges a first run hit."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from scheduler.settings import Settings
from tailpilot.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def readme_commands(prefixes: tuple[str, ...]) -> list[str]:
    """The README's shell lines (inside ```bash blocks) that start with one of ``prefixes``,
    continuation lines joined, trailing comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(prefixes):
                out.append(line)
    return out


SIM_EXAMPLES = readme_commands(("tailpilot sim", "tailpilot compare"))


def test_the_readme_has_sim_and_compare_examples():
    assert len(SIM_EXAMPLES) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("line", SIM_EXAMPLES)
def test_a_readme_example_runs_as_written_in_the_clone(line, monkeypatch):
    monkeypatch.chdir(ROOT)  # paths in the README are relative to the repository
    args = shlex.split(line)[1:]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, f"{line}\n{res.output}"


def test_every_file_a_readme_example_names_exists():
    for line in readme_commands(("tailpilot ",)):
        for arg in shlex.split(line):
            if re.search(r"\.(csv|jsonl)$", arg):
                assert (ROOT / arg).is_file(), f"{line}: {arg} is not in the repository"


def test_a_length_only_trace_takes_its_arrivals_from_target_rate():
    trace = str(FIXTURES / "sharegpt_lengths_head.csv")
    res = CliRunner().invoke(main, ["sim", "--trace", trace, "--policy", "fcfs"])
    assert res.exit_code == 2 and "--target-rate" in res.output and "rate=" not in res.output
    res = CliRunner().invoke(
        main, ["sim", "--trace", trace, "--policy", "fcfs", "--target-rate", "2", "--json"]
    )
    assert res.exit_code == 0, res.output


def test_a_length_distribution_says_how_to_use_it_instead_of_asking_for_a_rate_again():
    pmf = str(FIXTURES / "servegen_r1_pmf_small.csv")
    res = CliRunner().invoke(
        main, ["sim", "--trace", pmf, "--policy", "fcfs", "--target-rate", "2"]
    )
    assert res.exit_code == 2 and "a length distribution" in res.output and "--mix" in res.output


def test_compare_says_when_it_adds_the_baseline():
    res = CliRunner().invoke(main, ["compare", "--policy", "fcfs", "--to", "60", "--json"])
    assert res.exit_code == 0, res.output
    assert "the baseline sarathi is not in --policy" in res.stderr
    import json

    doc = json.loads(res.stdout)
    assert doc["baseline"] == "sarathi" and set(doc["metrics"]) == {"sarathi", "fcfs"}


def test_twins_can_start_side_by_side_on_different_policies():
    from tuner.twins.cluster import start_twins

    docs = [
        Settings.model_validate({"policy": "sarathi"}),
        Settings.model_validate({"policy": "uniboost"}),
    ]
    with start_twins(3, speed=50, settings=docs) as cluster:
        policies = [r.core.settings.policy for r in cluster.replicas]
    assert policies == ["sarathi", "uniboost", "sarathi"]


def test_the_demo_starts_side_by_side_by_default():
    from tailpilot.cli_twin import DEMO_POLICIES

    assert (
        DEMO_POLICIES[0]["policy"] == "sarathi" and len({d["policy"] for d in DEMO_POLICIES}) >= 3
    )
    for d in DEMO_POLICIES:  # what a live replica accepts (no oracle predictor)
        Settings.model_validate(d)
