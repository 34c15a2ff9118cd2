"""``python -m horovod.benchmarks.handoff``: two bare processes handing a buffer over through
shared memory the way the board does (no Horovod)."""

from __future__ import annotations

import os

import pytest

from horovod.benchmarks import handoff

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_one_job_times_both_sides_and_the_writer_alone():
    got = handoff.job(64 * 1024, 50)
    assert set(got) == {"writer", "reader", "alone"}
    assert all(0 < v < 0.1 for v in got.values()), got


def test_the_table_has_a_row_per_job_and_counts_the_slow_ones(capsys):
    assert handoff.main(["--sizes", "4K,64K", "--jobs", "2", "--rounds", "20"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 4 KiB |", "| 64 KiB |"))]
    assert len(rows) == 4, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2].removesuffix(" (slow)")) > 0 and float(cells[4]) > 0, row
    assert "64 KiB: " in out and " of 2 jobs slow" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sizes", "lots"], "--sizes: cannot read 'lots'"),
        (["--jobs", "0"], "must be 1 or more"),
    ],
)
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        handoff.main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
