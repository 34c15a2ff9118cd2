"""``python -m horovod.profile``: find the communication bottleneck of a PyTorch model, under
``horovodrun`` like the training job itself (docs/communication.md#the-profiler):

    horovodrun -np 4 -H a:2,b:2 python -m horovod.profile [--model mlp:512 | pkg.mod:factory]

Rank 0 prints: the gradient bytes per layer; each rank's compute and communication time per
step; the links (latency and bandwidth between every pair of hosts and within a host, against
``--expect-gbps``); the alpha-beta model's predicted step time, bytes and scaling efficiency at
``--hosts-at`` hosts for flat and hierarchical rings and each method; then real steps with each
method at this job's size, predicted against achieved. ``--json PATH`` saves it all.

A ``factory`` is a function returning ``(model, batch)``: a ``torch.nn.Module`` and a function
returning one ``(inputs, targets)`` batch for cross-entropy.

Must not touch: the engine (``horovod.profile.measure`` uses the public API).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from horovod.profile import costs, measure

METHODS = "none,fp16,int8,topk:0.01,powersgd:4,localsgd:8"


def builtin_mlp(hidden: int, batch_size: int) -> tuple[Any, Any]:
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(batch_size, 64, generator=g),
        torch.randint(0, 10, (batch_size,), generator=g),
    )
    return model, lambda: (x, y)


def factory(spec: str, batch_size: int) -> Any:
    if spec.startswith("mlp"):
        hidden = int(spec.partition(":")[2] or 512)
        return lambda: builtin_mlp(hidden, batch_size)
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"--model {spec!r}: give mlp[:hidden] or module:factory")
    fn = getattr(importlib.import_module(module), name)
    return fn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m horovod.profile", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="mlp:512")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="timed steps per figure")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--hosts-at", default="2,4,8,16,32")
    p.add_argument("--expect-gbps", type=float, default=None, help="the links' nominal speed")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: cores / ranks per host)",
    )
    a = p.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    for m in methods:
        costs.communication(m, [(1,)], costs.Layout(1), costs.Link(0, 0), costs.Link(0, 0))
    import horovod.torch as hvd

    hvd.init(process_sets="dynamic")
    import os

    import torch

    # one rank per share of the cores: torch's default (every core) makes ranks fight
    torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // hvd.local_size()))
    make = factory(a.model, a.batch_size)
    model, batch = make()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    layers = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    shapes = [s for _, s in layers]
    hosts = measure.hosts_of_ranks(hvd)
    compute_s, comm_s = measure.step_times(hvd, model, batch, a.steps)
    per_rank = hvd.allgather_object((hvd.rank(), compute_s, comm_s))
    links = measure.probe_links(hvd, hosts, max(5, a.steps))
    achieved = {m: measure.achieved(hvd, lambda: make()[0], batch, m, a.steps) for m in methods}
    if hvd.rank() == 0:
        report = build_report(a, layers, shapes, hosts, per_rank, links, achieved, methods)
        print(render(report, a), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
    hvd.shutdown()
    return 0


ASSUMED_LATENCY_S = 50e-6  # a LAN round of one message, when no network was measured


def links_of(
    report_links: dict[str, Any], expect_gbps: float | None
) -> tuple[costs.Link | None, costs.Link]:
    """(network link, link within a host): the worst measured pair of each kind; without a
    measured network pair, ``--expect-gbps`` at ASSUMED_LATENCY_S, or None."""
    net = [x for x in report_links["pairs"] if x["kind"] == "net"]
    local = [x for x in report_links["pairs"] if x["kind"] == "local"]

    def worst(rows: list[dict]) -> costs.Link:
        lat = max(r["latency_s"] for r in rows)
        bw = min(r["bytes_per_s"] for r in rows)
        return costs.Link.from_figures(lat, bw)

    local_link = worst(local) if local else costs.Link(0.0, 0.0)
    if net:
        return worst(net), local_link
    if expect_gbps:
        return costs.Link.from_figures(ASSUMED_LATENCY_S, expect_gbps * 1e9 / 8), local_link
    return None, local_link


def build_report(a, layers, shapes, hosts, per_rank, links, achieved, methods) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    compute = max(c for _, c, _ in per_rank)  # the slowest rank sets the pace
    measured_net, local = links_of(links, a.expect_gbps)
    here = costs.Layout(len(hosts), max(len(h) for h in hosts))
    net = measured_net or local
    predictions = []
    at = [int(x) for x in a.hosts_at.split(",") if x.strip()]
    if measured_net is None:
        at = [h for h in at if h == 1]  # no network figures: nothing to say beyond one host
    for h in at:
        layout = costs.Layout(h, here.per_host)
        for hier in (False, True) if here.per_host > 1 else (False,):
            for m in methods:
                step, eff, sent = costs.predict(m, shapes, compute, layout, net, local, hier)
                predictions.append(
                    {
                        "hosts": h,
                        "per_host": here.per_host,
                        "hierarchical": hier,
                        "method": m,
                        "step_s": step,
                        "efficiency": eff,
                        "bytes_per_rank": sent,
                    }
                )
    versus = []
    for m in methods:
        step, _, sent = costs.predict(m, shapes, compute, here, net, local, False)
        versus.append(
            {"method": m, "predicted_s": step, "achieved_s": achieved[m], "bytes_per_rank": sent}
        )
    return {
        "layers": [
            {"name": n, "shape": list(s), "bytes": costs.FLOAT * _size(s)} for n, s in layers
        ],
        "hosts": hosts,
        "ranks": [{"rank": r, "compute_s": c, "communication_s": m} for r, c, m in per_rank],
        "links": links,
        "network": (
            "measured"
            if any(x["kind"] == "net" for x in links["pairs"])
            else (f"assumed: --expect-gbps {a.expect_gbps}" if measured_net else "none")
        ),
        "model": {
            "net_alpha_s": net.alpha,
            "net_beta_s_per_byte": net.beta,
            "local_alpha_s": local.alpha,
            "local_beta_s_per_byte": local.beta,
            "compute_s": compute,
        },
        "predictions": predictions,
        "predicted_vs_achieved": versus,
    }


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def render(r: dict[str, Any], a: argparse.Namespace) -> str:
    out = ["## Gradients per layer", "", "| layer | shape | bytes |", "|---|---|---:|"]
    for layer in r["layers"]:
        out.append(f"| {layer['name']} | {tuple(layer['shape'])} | {layer['bytes']:,} |")
    total = sum(x["bytes"] for x in r["layers"])
    out += [f"| total | | {total:,} |", ""]
    out += [
        "## Compute and communication per step, per rank",
        "",
        "| rank | compute | communication (allreduce of every gradient) | communication share |",
        "|---:|---:|---:|---:|",
    ]
    for x in r["ranks"]:
        share = x["communication_s"] / max(x["compute_s"] + x["communication_s"], 1e-12)
        out.append(
            f"| {x['rank']} | {x['compute_s'] * 1e3:.2f} ms | "
            f"{x['communication_s'] * 1e3:.2f} ms | {share:.0%} |"
        )
    out += [
        "",
        "## Links",
        "",
        "| pair | ranks | latency | bandwidth | of expected |",
        "|---|---|---:|---:|---:|",
    ]
    for x in r["links"]["pairs"]:
        gbps = x["bytes_per_s"] * 8 / 1e9
        expect = f"{gbps / a.expect_gbps:.0%}" if a.expect_gbps and x["kind"] == "net" else "-"
        out.append(
            f"| {x['pair']} | {x['ranks'][0]}-{x['ranks'][1]} | "
            f"{x['latency_s'] * 1e6:.0f} us | {gbps:.2f} Gbit/s | {expect} |"
        )
    if not r["links"]["pairs"]:
        out.append("| (one rank: nothing to probe) | | | | |")
    out += [
        "",
        "## Predicted (alpha-beta model, no overlap)",
        "",
    ]
    if r["network"] == "none":
        out += [
            "No network link was measured (one host): give --expect-gbps to predict larger "
            "jobs, or run the profiler across hosts.",
            "",
        ]
    elif r["network"].startswith("assumed"):
        out += [
            f"Network {r['network']} Gbit/s, {ASSUMED_LATENCY_S * 1e6:.0f} us per message "
            "(one host: not measured).",
            "",
        ]
    out += [
        "| hosts x ranks | ring | method | step | efficiency | bytes sent per rank |",
        "|---|---|---|---:|---:|---:|",
    ]
    for x in r["predictions"]:
        out.append(
            f"| {x['hosts']} x {x['per_host']} | "
            f"{'hierarchical' if x['hierarchical'] else 'flat'} | {x['method']} | "
            f"{x['step_s'] * 1e3:.2f} ms | {x['efficiency']:.0%} | "
            f"{x['bytes_per_rank'] / 1e6:.2f} MB |"
        )
    out += [
        "",
        "## This job: predicted against achieved",
        "",
        "| method | predicted step | achieved step | achieved / predicted |",
        "|---|---:|---:|---:|",
    ]
    for x in r["predicted_vs_achieved"]:
        out.append(
            f"| {x['method']} | {x['predicted_s'] * 1e3:.2f} ms | "
            f"{x['achieved_s'] * 1e3:.2f} ms | {x['achieved_s'] / x['predicted_s']:.2f} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
