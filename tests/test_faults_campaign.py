"""The reliability campaign (``python -m horovod.benchmarks.faults``) in a short run: every kind
of fault against real horovodrun jobs, each trial required to pass (its long-run figures are in
docs/errors.md). And the campaign itself fails when a trial does."""

import re

import pytest
from conftest import run_module

from horovod.benchmarks import faults
from horovod.testing.netns import unavailable

pytestmark = pytest.mark.e2e


def table_row(out: str, kind: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(f"| {kind} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_short_campaign_of_kills_stalls_and_fuzzing():
    r = run_module(
        "horovod.benchmarks.faults",
        "--trials",
        "2",
        "--kinds",
        "kill,name,fuzz",
        "--seed",
        "1",
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for kind in ("kill", "name", "fuzz"):
        cells = table_row(r.stdout, kind)
        assert cells[1:4] == ["2", "2", "0"], cells  # trials, passed, hangs
        assert re.match(r"\d+\.\d\d s \(\d+\.\d\d s\)", cells[4]), cells


def test_every_mismatched_field_reaches_every_rank():
    n = len(faults.FIELDS)
    r = run_module(
        "horovod.benchmarks.faults",
        "--trials",
        str(n),
        "--kinds",
        "mismatch",
        "--seed",
        "2",
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert table_row(r.stdout, "mismatch")[1:4] == [str(n), str(n), "0"]
    assert table_row(r.stdout, "mismatch")[5] == "0"  # errors missing on some rank
    fields = set(re.findall(r'"field": "(\w+)"', r.stdout))
    assert fields == set(faults.FIELDS)


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_lost_host_trial():
    r = run_module(
        "horovod.benchmarks.faults",
        "--trials",
        "1",
        "--kinds",
        "lost-host",
        "--seed",
        "3",
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert table_row(r.stdout, "lost-host")[1:4] == ["1", "1", "0"]


def test_a_failed_trial_fails_the_campaign(monkeypatch, capsys):
    def broken(self):
        return faults.Trial("kill", {"np": 2}, passed=False, hung=True, why="no end")

    monkeypatch.setattr(faults.Campaign, "kill", broken)
    assert faults.main(["--trials", "1", "--kinds", "kill"]) == 1
    out = capsys.readouterr().out
    assert table_row(out, "kill")[1:4] == ["1", "0", "1"]
    assert '- kill {"np": 2}: no end' in out
