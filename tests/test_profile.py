"""The profiler (issue 35): the alpha-beta model's formulas, and ``python -m horovod.profile``
under horovodrun printing every section with figures that hang together."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from horovod.profile import costs
from tests.conftest import REPO

NET = costs.Link(alpha=1e-4, beta=1e-8)  # 100 us per message, 100 MB/s
LOCAL = costs.Link(alpha=1e-5, beta=1e-10)


def test_ring_and_gather_follow_the_alpha_beta_formulas():
    assert costs.ring(1e6, 1, NET) == 0.0
    assert costs.ring(1e6, 4, NET) == pytest.approx(6 * 1e-4 + 1.5 * 1e6 * 1e-8)
    assert costs.gather(1e5, 4, NET) == pytest.approx(3 * 1e-4 + 3 * 1e5 * 1e-8)
    # hierarchical: the host's ranks over the local link, then one ring over the hosts
    layout = costs.Layout(hosts=4, per_host=2)
    flat = costs.allreduce(1e6, layout, NET, LOCAL, hierarchical=False)
    hier = costs.allreduce(1e6, layout, NET, LOCAL, hierarchical=True)
    assert flat == pytest.approx(costs.ring(1e6, 8, NET))
    assert hier == pytest.approx(costs.ring(1e6, 2, LOCAL) + costs.ring(1e6, 4, NET))
    assert hier < flat


def test_methods_change_what_travels():
    shapes = [(512, 512), (512,)]
    total = (512 * 512 + 512) * 4
    layout = costs.Layout(hosts=4)
    t_none, b_none = costs.communication("none", shapes, layout, NET, LOCAL)
    t_fp16, b_fp16 = costs.communication("fp16", shapes, layout, NET, LOCAL)
    assert b_none == pytest.approx(1.5 * total) and b_fp16 == pytest.approx(b_none / 2)
    _, b_int8 = costs.communication("int8", shapes, layout, NET, LOCAL)
    assert b_int8 == pytest.approx(3 * (total / 4 + 65 * 4))  # 1 byte each + a scale per 4096
    _, b_topk = costs.communication("topk:0.01", shapes, layout, NET, LOCAL)
    assert b_topk == pytest.approx(3 * (2622 + 6) * 8)  # values and indices of each tensor
    p, q = costs.powersgd_bytes(shapes, 4)
    assert (p, q) == (512 * 4 * 4 + 512 * 4, 512 * 4 * 4)  # the bias goes exact, with P
    t_local, _ = costs.communication("localsgd:8", shapes, layout, NET, LOCAL)
    assert t_local == pytest.approx(t_none / 8)
    step, eff, _ = costs.predict("none", shapes, 0.01, layout, NET, LOCAL)
    assert step == pytest.approx(0.01 + t_none) and eff == pytest.approx(0.01 / step)
    with pytest.raises(ValueError, match="unknown method 'zip'"):
        costs.communication("zip", shapes, layout, NET, LOCAL)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_profiler_runs_under_horovodrun_and_reports_every_section(tmp_path):
    out = tmp_path / "profile.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "horovod.runner.launch",
            "-np",
            "2",
            sys.executable,
            "-m",
            "horovod.profile",
            "--model",
            "mlp:64",
            "--steps",
            "3",
            "--hosts-at",
            "2,4",
            "--expect-gbps",
            "1",
            "--methods",
            "none,int8,localsgd:4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for section in (
        "Gradients per layer",
        "Compute and communication per step",
        "## Links",
        "Predicted",
        "predicted against achieved",
    ):
        assert section in r.stdout, section
    report = json.loads(out.read_text())
    assert sum(x["bytes"] for x in report["layers"]) == 4 * (
        64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    )
    assert [x["rank"] for x in report["ranks"]] == [0, 1]
    (pair,) = report["links"]["pairs"]  # one host: the pair within it
    assert pair["kind"] == "local" and pair["latency_s"] > 0 and pair["bytes_per_s"] > 0
    assert report["network"].startswith("assumed")
    assert {(p["hosts"], p["method"]) for p in report["predictions"]} >= {(4, "int8")}
    assert [v["method"] for v in report["predicted_vs_achieved"]] == ["none", "int8", "localsgd:4"]
    assert all(v["achieved_s"] > 0 for v in report["predicted_vs_achieved"])
