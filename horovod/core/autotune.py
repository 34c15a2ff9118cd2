"""Autotune: find the fusion threshold, cycle time and response-cache setting that move the
most allreduce bytes per second for *this* job, while it trains.

How (upstream's method, with two guards of our own):

* Rank 0 scores the current parameters by allreduce throughput on the global process set:
  bytes of the allreduced tensors divided by wall time. A *sample* ends when some tensor has
  been allreduced ``steps_per_sample`` times (one "step" of training); a configuration's score is
  the median of ``SAMPLES_PER_CONFIG`` samples. The first ``warmup_samples`` samples are dropped.
* The starting configuration is scored first (the baseline).
* Fusion threshold (0..64 MiB) and cycle time (1..100 ms) are tuned jointly by Bayesian
  optimisation: a Gaussian process (RBF kernel, length scale chosen by marginal likelihood,
  NumPy only) and Expected Improvement, starting from upstream's four test points.
  ``bayes_opt_max_samples`` configurations in all.
* Then the response cache is tried the other way round at the best point so far.
* Guard: before adopting the winner, it and the baseline are measured once more, back to back,
  and the baseline is kept unless the winner is faster again: tuning never leaves the job slower
  than it started.
* Knobs the user set explicitly (environment or horovodrun flag) are fixed, as upstream.

Every trial is a row of the CSV log (upstream's columns); the end of tuning logs one line that
explains the choice, e.g. ``fusion 128 MiB -> 8 MiB, cycle 1 ms -> 3.2 ms: +12% throughput``.

Must not touch: the engine's tables (it proposes parameters; the coordinator applies them on
every rank).
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import IO

import numpy as np

MiB = 1024 * 1024
SAMPLES_PER_CONFIG = 5
FUSION_MB_BOUNDS = (0.0, 64.0)
CYCLE_MS_BOUNDS = (1.0, 100.0)
MIN_GAIN = 0.02  # a winner must beat the baseline by this much when both are measured again
TEST_POINTS = ((4.0, 5.0), (32.0, 50.0), (16.0, 25.0), (8.0, 10.0))  # upstream's (MB, ms)
COLUMNS = [
    "hierarchical_allreduce",
    "hierarchical_allgather",
    "torus_allreduce",
    "cache_enabled",
    "cycle_time_ms",
    "tensor_fusion_threshold",
    "score",
]


@dataclass(frozen=True)
class Params:
    fusion_bytes: int
    cycle_ms: float
    cache: bool
    hierarchical_allreduce: bool = False
    hierarchical_allgather: bool = False

    def row(self) -> list[str]:
        return [
            str(int(self.hierarchical_allreduce)),
            str(int(self.hierarchical_allgather)),
            "0",
            str(int(self.cache)),
            f"{self.cycle_ms:.3f}",
            f"{self.fusion_bytes / MiB:.3f}",
        ]

    def wire(self) -> tuple[int, float, bool]:
        return (self.fusion_bytes, self.cycle_ms, self.cache)


def _mib(n: int) -> str:
    return f"{n / MiB:.3g} MiB"


def _describe(p: Params) -> str:
    return (
        f"fusion {_mib(p.fusion_bytes)}, cycle {p.cycle_ms:.3g} ms, response cache "
        f"{'on' if p.cache else 'off'}"
    )


def explain(
    start: Params,
    best: Params,
    start_score: float,
    best_score: float,
    rejected: tuple[Params, float] | None = None,
) -> str:
    changes = []
    if best.fusion_bytes != start.fusion_bytes:
        changes.append(f"fusion {_mib(start.fusion_bytes)} -> {_mib(best.fusion_bytes)}")
    if best.cycle_ms != start.cycle_ms:
        changes.append(f"cycle {start.cycle_ms:.3g} ms -> {best.cycle_ms:.3g} ms")
    if best.cache != start.cache:
        changes.append(
            f"response cache {'on' if start.cache else 'off'} -> {'on' if best.cache else 'off'}"
        )
    rate = f"{best_score / 1e6:.1f} MB/s allreduced"
    if not changes:
        why = "no candidate scored higher"
        if rejected is not None:
            gain = 100.0 * (rejected[1] / start_score - 1.0) if start_score > 0 else 0.0
            why = (
                f"the best candidate ({_describe(rejected[0])}) was {gain:+.1f}% when both "
                f"were measured again, less than the {MIN_GAIN:.0%} needed to switch"
            )
        return (
            f"Autotune finished: keeping the starting configuration ({_describe(start)}); "
            f"{why} ({rate})."
        )
    gain = 100.0 * (best_score / start_score - 1.0) if start_score > 0 else float("inf")
    return f"Autotune finished: {', '.join(changes)}: {gain:+.0f}% throughput ({rate})."


# ----------------------------------------------------------------------------- Gaussian process
class GaussianProcess:
    """GP regression on points in the unit square: isotropic RBF kernel with unit signal
    variance on standardised scores, noise ``alpha``, length scale picked by log marginal
    likelihood over a grid (robust, and no SciPy needed in two dimensions)."""

    LENGTHS = np.geomspace(0.05, 2.0, 24)

    def __init__(self, alpha: float) -> None:
        self.alpha = max(alpha, 1e-6)

    @staticmethod
    def _k(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
        d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return np.exp(-0.5 * d2 / length**2)

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x = x
        self.mean = float(y.mean())
        self.scale = float(y.std()) if len(y) >= 3 and y.std() > 0 else max(abs(self.mean), 1.0)
        yn = (y - self.mean) / self.scale
        best = None
        for length in self.LENGTHS:
            k = self._k(x, x, length) + self.alpha * np.eye(len(x))
            try:
                chol = np.linalg.cholesky(k)
            except np.linalg.LinAlgError:
                continue
            a = np.linalg.solve(chol.T, np.linalg.solve(chol, yn))
            lml = -0.5 * float(yn @ a) - float(np.log(np.diag(chol)).sum())
            if best is None or lml > best[0]:
                best = (lml, length, chol, a)
        assert best is not None
        _, self.length, self.chol, self.a = best

    def predict(self, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ks = self._k(xs, self.x, self.length)
        mu = ks @ self.a
        v = np.linalg.solve(self.chol, ks.T)
        var = np.clip(1.0 - (v**2).sum(0), 1e-12, None)
        return mu * self.scale + self.mean, np.sqrt(var) * self.scale


_erf = np.vectorize(math.erf)


def expected_improvement(
    mu: np.ndarray, sigma: np.ndarray, best: float, xi: float = 0.01
) -> np.ndarray:
    imp = mu - best - xi * abs(best)
    z = imp / sigma
    cdf = 0.5 * (1.0 + _erf(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z**2) / math.sqrt(2.0 * math.pi)
    return imp * cdf + sigma * pdf


class BayesianOptimizer:
    """Maximises a noisy function over a box; points are given in real units."""

    def __init__(
        self,
        bounds: Sequence[tuple[float, float]],
        noise: float,
        first: Sequence[Sequence[float]] = (),
        seed: int = 0,
        candidates: int = 2048,
    ) -> None:
        self.lo = np.array([b[0] for b in bounds], float)
        self.hi = np.array([b[1] for b in bounds], float)
        self.first = [np.array(p, float) for p in first]
        self.gp = GaussianProcess(noise)
        self.rng = np.random.default_rng(seed)
        self.n_candidates = candidates
        self.xs: list[np.ndarray] = []
        self.ys: list[float] = []

    def _unit(self, p: np.ndarray) -> np.ndarray:
        return (p - self.lo) / np.where(self.hi > self.lo, self.hi - self.lo, 1.0)

    def _real(self, u: np.ndarray) -> np.ndarray:
        return self.lo + u * (self.hi - self.lo)

    def observe(self, point: Sequence[float], score: float) -> None:
        self.xs.append(self._unit(np.array(point, float)))
        self.ys.append(float(score))

    def suggest(self) -> list[float]:
        if len(self.xs) < len(self.first):
            return [float(v) for v in self.first[len(self.xs)]]
        x, y = np.array(self.xs), np.array(self.ys)
        self.gp.fit(x, y)
        cand = self.rng.random((self.n_candidates, x.shape[1]))
        best_x = x[int(np.argmax(y))]
        local = np.clip(best_x + 0.05 * self.rng.standard_normal((256, x.shape[1])), 0, 1)
        cand = np.vstack([cand, local])
        mu, sigma = self.gp.predict(cand)
        ei = expected_improvement(mu, sigma, float(y.max()))
        return [float(v) for v in self._real(cand[int(np.argmax(ei))])]

    def best(self) -> tuple[list[float], float]:
        i = int(np.argmax(self.ys))
        return [float(v) for v in self._real(self.xs[i])], self.ys[i]


# ----------------------------------------------------------------------------- the tuner
class Autotuner:
    """Driven by rank 0's engine: ``record()`` after each allreduce response of the global set;
    it returns new parameters when the engine must switch, else None."""

    def __init__(
        self,
        start: Params,
        *,
        tune_fusion: bool = True,
        tune_cycle: bool = True,
        tune_cache: bool = True,
        warmup_samples: int = 3,
        steps_per_sample: int = 10,
        max_samples: int = 20,
        noise: float = 0.8,
        log_file: str = "",
        report: Callable[[str], None] = print,
        seed: int = 0,
    ) -> None:
        self.start = self.current = start
        self.tune_fusion, self.tune_cycle, self.tune_cache = tune_fusion, tune_cycle, tune_cache
        self.warmup_left = warmup_samples
        self.steps_per_sample = max(1, steps_per_sample)
        self.max_samples = max_samples
        self.report = report
        self.bo = BayesianOptimizer(
            [FUSION_MB_BOUNDS, CYCLE_MS_BOUNDS],
            noise,
            first=[p for p in TEST_POINTS] if tune_fusion or tune_cycle else (),
            seed=seed,
        )
        self.done = False
        self.summary = ""
        self.trials: list[tuple[Params, float]] = []
        self.baseline_score: float | None = None
        self.bo_trials = 0
        self.phase = "baseline"
        self.confirm: list[tuple[Params, float]] = []
        self.winner: Params | None = None
        self._counts: dict[str, int] = {}
        self._bytes = 0
        self._t0: float | None = None
        self._samples: list[float] = []
        self._log: IO[str] | None = None
        self._csv = None
        if log_file:
            self._log = open(log_file, "w", newline="")  # noqa: SIM115 - closed at the end
            self._csv = csv.writer(self._log)
            self._csv.writerow(COLUMNS)
            self._log.flush()

    @property
    def tunable(self) -> bool:
        return self.tune_fusion or self.tune_cycle or self.tune_cache

    def record(self, names: Sequence[str], nbytes: int, now: float) -> Params | None:
        if self.done:
            return None
        if self._t0 is None:
            self._t0 = now
            self._counts = {}
            self._bytes = 0
        self._bytes += nbytes
        step = 0
        for n in names:
            c = self._counts.get(n, 0) + 1
            self._counts[n] = c
            step = max(step, c)
        if step < self.steps_per_sample:
            return None
        elapsed = max(now - self._t0, 1e-9)
        score = self._bytes / elapsed
        self._t0, self._counts, self._bytes = now, {}, 0
        if self.warmup_left > 0:
            self.warmup_left -= 1
            return None
        self._samples.append(score)
        if len(self._samples) < SAMPLES_PER_CONFIG:
            return None
        score = statistics.median(self._samples)
        self._samples = []
        return self._next(score)

    # ---------------------------------------------------------------- the search
    def _trial(self, params: Params, score: float) -> None:
        self.trials.append((params, score))
        if self._csv is not None and self._log is not None:
            self._csv.writerow(params.row() + [f"{score:.1f}"])
            self._log.flush()

    def _switch(self, params: Params) -> Params | None:
        self._t0 = None  # the next sample starts with the new parameters
        if params == self.current:
            return None
        self.current = params
        return params

    def _point(self, params: Params) -> list[float]:
        return [params.fusion_bytes / MiB, params.cycle_ms]

    def _from_point(self, point: Sequence[float], cache: bool) -> Params:
        fusion = self.start.fusion_bytes
        cycle = self.start.cycle_ms
        if self.tune_fusion:
            fusion = int(round(point[0] * 4)) * MiB // 4  # quarter-MiB steps
        if self.tune_cycle:
            cycle = round(point[1], 1)
        return replace(self.start, fusion_bytes=fusion, cycle_ms=cycle, cache=cache)

    def _next(self, score: float) -> Params | None:
        params = self.current
        if self.phase == "baseline":
            self.baseline_score = score
            self._trial(params, score)
            if not self.tunable:
                return self._finish(params, score, score)
            self.phase = "bayes" if (self.tune_fusion or self.tune_cycle) else "cache"
            if self.phase == "cache":
                return self._switch(replace(params, cache=not params.cache))
            return self._switch(self._from_point(self.bo.suggest(), self.start.cache))
        if self.phase == "bayes":
            self._trial(params, score)
            self.bo.observe(self._point(params), score)
            self.bo_trials += 1
            if self.bo_trials < self.max_samples:
                return self._switch(self._from_point(self.bo.suggest(), self.start.cache))
            self.phase = "cache"
            if self.tune_cache:
                best = max(self.trials, key=lambda t: t[1])[0]
                return self._switch(replace(best, cache=not self.start.cache))
            return self._begin_confirm()
        if self.phase == "cache":
            self._trial(params, score)
            return self._begin_confirm()
        if self.phase == "confirm":
            self.confirm.append((params, score))
            if len(self.confirm) == 1:  # the winner measured again; now the baseline again
                return self._switch(self.start)
            (winner, w_score), (_, b_score) = self.confirm
            if w_score > b_score * (1.0 + MIN_GAIN):
                return self._finish(winner, b_score, w_score)
            return self._finish(self.start, b_score, b_score, rejected=(winner, w_score))
        return None

    def _begin_confirm(self) -> Params | None:
        winner = max(self.trials, key=lambda t: t[1])[0]
        if winner == self.start:
            base = self.baseline_score or 0.0
            return self._finish(self.start, base, base)
        self.phase = "confirm"
        return self._switch(winner)

    def _finish(
        self,
        best: Params,
        start_score: float,
        best_score: float,
        rejected: tuple[Params, float] | None = None,
    ) -> Params | None:
        self.done = True
        self.winner = best
        if self._csv is not None and self._log is not None:
            self._csv.writerow(best.row() + [f"{best_score:.1f}"])
            self._log.close()
            self._log = None
        self.summary = explain(self.start, best, start_score, best_score, rejected)
        self.report(self.summary)
        self._t0 = None
        if best == self.current:
            return None
        self.current = best
        return best

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
