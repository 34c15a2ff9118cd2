"""``python -m horovod.benchmarks.training_ab``: lockstep, horovod.torch and DDP trained in turn
in the same two processes, with ratios paired within each round."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from conftest import run_module  # noqa: E402

from horovod.benchmarks import training_ab  # noqa: E402


def test_ratios_are_paired_within_each_round():
    """Each round's ratio is its own reference time over its own horovod time: a slow round
    for everyone (round 2 here) moves no ratio, where best-of figures would pair round 1's
    lockstep with round 2's horovod."""
    times = {
        "lockstep": [0.010, 0.020, 0.011],
        "horovod": [0.011, 0.022, 0.010],
        "ddp": [0.012, 0.026, 0.012],
    }
    s = training_ab.summary(times)
    assert s["lockstep"] == pytest.approx((10 / 11, 10 / 11, 1.1))
    assert s["ddp"] == pytest.approx((26 / 22, 12 / 11, 1.2))


def test_the_table_says_whether_issue_37s_targets_are_met():
    """0.95x lockstep on every model, and 1.15x DDP on the conv model only."""
    met = {"lockstep": [0.010] * 3, "horovod": [0.0104] * 3, "ddp": [0.0125] * 3}
    short_of_ddp = {"lockstep": [0.010] * 3, "horovod": [0.0104] * 3, "ddp": [0.011] * 3}
    rows = training_ab.table({"convnet": met, "mlp200": short_of_ddp}, 3, 10)
    conv = next(r for r in rows if r.startswith("| convnet |"))
    mlp = next(r for r in rows if r.startswith("| mlp200 |"))
    assert conv.endswith("| met |") and "0.962x" in conv and "1.202x" in conv
    assert mlp.endswith("| met |")  # (its DDP ratio, 1.058x, is no target of mlp200's)
    rows = training_ab.table({"convnet": short_of_ddp}, 3, 10)
    assert rows[2].endswith("| not met |")
    slow = {"lockstep": [0.010] * 3, "horovod": [0.011] * 3, "ddp": [0.020] * 3}
    assert training_ab.table({"mlp200": slow}, 3, 10)[2].endswith("| not met |")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--models", "resnet9000"], "unknown model(s) resnet9000"),
        (["--rounds", "0"], "--rounds and --steps of 1 or more"),
        (["--warmup", "-1"], "--warmup >= 0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        training_ab.main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.e2e
def test_a_short_run_prints_one_row_per_model():
    r = run_module(
        "horovod.benchmarks.training_ab",
        *("--models", "convnet,mlp200", "--rounds", "2", "--steps", "1", "--warmup", "1"),
        *("--batch-size", "4"),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for model in ("convnet", "mlp200"):
        row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {model} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 7, row
        assert all(float(c.removesuffix(" ms")) > 0 for c in cells[1:4]), row
        assert cells[4].endswith(")") and "x (" in cells[4], row
        assert cells[6] in ("met", "not met"), row
    assert "medians over 2 rounds of 1 steps each" in r.stdout
