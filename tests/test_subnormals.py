"""Float32 buffers that hold subnormal values are scaled through float64 (``subnormals``) where
this CPU charges for them: the same bits as a float32 multiplication or division, without x86's
microcode assists. The arithmetic is checked on every float32 of small magnitude and on random
bit patterns, the per-CPU threshold on timings built for it, the sampling and its schedule on
buffers built for it, and Average allreduces of large buffers a third of whose values are
subnormal against the correctly rounded quotient at 2 and 3 ranks."""

from __future__ import annotations

import numpy as np
import pytest

import horovod.numpy as hvd
from horovod.collectives import algorithms as alg
from horovod.collectives import subnormals
from horovod.testing import run_ranks

TINY = np.float32(2.0**-149)  # the least subnormal float32


@pytest.fixture
def pays_from_a_tenth(monkeypatch):
    """A CPU on which the float64 way pays from a tenth of the values subnormal (the routing
    tests run on any CPU; ``threshold`` on this one may say never)."""
    monkeypatch.setattr(subnormals, "_THRESHOLD", [0.1])


def bit_patterns() -> np.ndarray:
    """Every float32 below 2**-123 in magnitude (all subnormals and the least normals, both
    signs), the specials, and a million random bit patterns."""
    low = np.arange(1 << 25, dtype=np.int32)
    rand = np.random.default_rng(3).integers(-(2**31), 2**31 - 1, 1 << 20, dtype=np.int64)
    specials = np.array([np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1.0, -0.0], np.float32)
    return np.concatenate(
        [low, low | np.int32(-(2**31)), rand.astype(np.int32), specials.view(np.int32)]
    ).view(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.all((a.view(np.int32) == b.view(np.int32)) | (np.isnan(a) & np.isnan(b))))


@pytest.fixture(scope="module")
def patterns() -> np.ndarray:
    return bit_patterns()


@pytest.mark.parametrize("factor", [0.5, 0.25, 1 / 3, 0.1, 3.0, 1e30])
def test_multiply_through_float64_gives_float32_bits(patterns, factor):
    want = patterns.copy()
    got = patterns.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        np.multiply(want, np.float32(factor), out=want)
        subnormals.multiply(got, factor)
    assert same_bits(want, got)


@pytest.mark.parametrize("n", [3, 5, 6, 7, 1000])
def test_divide_through_float64_gives_the_correctly_rounded_float32_quotient(patterns, n):
    want = patterns.copy()
    got = patterns.copy()
    with np.errstate(invalid="ignore"):
        np.divide(want, np.float32(n), out=want)
        subnormals.divide(got, n)
    assert same_bits(want, got)


def test_through_float64_flushes_as_float32_does_where_the_thread_flushes(patterns):
    """A job whose ``hvd.init()`` thread flushes subnormals to zero computes its reductions so
    (``fpenv``): the float64 way must flush the same values (the conversions read subnormal
    inputs as zero and flush subnormal results, as the float32 arithmetic does)."""
    torch = pytest.importorskip("torch")
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        for factor in (0.5, 1 / 3, 3.0):
            want, got = patterns.copy(), patterns.copy()
            with np.errstate(over="ignore", invalid="ignore"):
                np.multiply(want, np.float32(factor), out=want)
                subnormals.multiply(got, factor)
            assert same_bits(want, got), factor
        want, got = patterns.copy(), patterns.copy()
        with np.errstate(invalid="ignore"):
            np.divide(want, np.float32(3), out=want)
            subnormals.divide(got, 3)
        assert same_bits(want, got)
        assert not np.any((want != 0) & (np.abs(want) < np.finfo(np.float32).smallest_normal))
    finally:
        torch.set_flush_denormal(False)


def test_subnormals_are_found_in_any_sampled_run_and_zeros_are_not():
    normal = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
    assert not subnormals.share(normal)
    assert not subnormals.share(np.zeros(1 << 16, np.float32))
    assert not subnormals.share(-np.zeros(1 << 16, np.float32))
    assert not subnormals.share(np.full(1 << 16, np.finfo(np.float32).smallest_normal))
    for sign in (1, -1):
        third = normal.copy()
        third[::3] = sign * 5 * TINY
        assert subnormals.share(third)
    largest = normal.copy()
    largest[(1 << 16) // 2] = np.float32(2.0**-126) - TINY  # the largest subnormal, one value
    assert subnormals.share(largest)  # (the start of a sampled run)
    assert subnormals.share(np.array([0, TINY], np.float32))  # a part too small: all of it
    assert not subnormals.share(np.zeros(0, np.float32))


def test_the_share_is_counted_in_the_sampled_runs():
    x = np.ones(1 << 16, np.float32)
    assert subnormals.share(x) == 0.0
    x[::4] = 3 * TINY
    assert subnormals.share(x) == 0.25
    x[:] = -TINY
    assert subnormals.share(x) == 1.0
    assert subnormals.share(np.array([0, TINY, 1, 2], np.float32)) == 0.25  # (all of a small one)


@pytest.mark.parametrize(
    "normal, subnormal, wide, want",
    [
        (1.0, 40.0, 6.0, 2 * 5 / 39),  # assists (x86 of stop 55): from about a quarter
        (1.0, 100.0, 0.5, 0.0),  # the float64 way cheaper than even normal values: always
        (4.2, 3.8, 20.5, float("inf")),  # no extra cost (AMD EPYC, stop 58): never
        (1.0, 5.0, 6.0, float("inf")),  # an extra cost, but the float64 way costs more: never
    ],
)
def test_the_threshold_is_where_the_float64_way_gets_faster(normal, subnormal, wide, want):
    """From the times of one block: float32 with normal and with subnormal values, and the
    float64 way; twice the break-even share, so that a share near it stays in float32."""
    times = iter([normal, subnormal, wide])
    assert subnormals._measured(lambda fn: next(times)) == pytest.approx(want)


def test_the_threshold_is_timed_once_per_process(monkeypatch):
    monkeypatch.setattr(subnormals, "_THRESHOLD", [None])
    timed = []
    real = subnormals._measured
    monkeypatch.setattr(subnormals, "_measured", lambda t: timed.append(1) or real(t))
    first = subnormals.threshold()
    assert first >= 0.0 and subnormals.threshold() == first and timed == [1]


def test_likely_looks_at_every_buffer_of_a_size_while_it_finds_some_else_one_in_recheck(
    pays_from_a_tenth,
):
    size = subnormals.MIN_ELEMENTS + 12345  # (sizes no other test uses: fresh schedules)
    found = np.full(size, TINY, np.float32)
    normal = np.ones(size, np.float32)
    few = np.ones(size, np.float32)
    few[::16] = TINY  # (a sixteenth: below the threshold)
    other = np.full(size + 1, TINY, np.float32)
    assert all(subnormals.likely(found) for _ in range(3))
    assert not subnormals.likely(few)  # looked, found too few ...
    assert subnormals.likely(other)  # (another size: its own schedule)
    skipped = [subnormals.likely(found) for _ in range(subnormals.RECHECK - 1)]
    assert skipped == [False] * (subnormals.RECHECK - 1)  # ... so the next ones are not looked at
    assert subnormals.likely(found)
    assert subnormals.likely(other)
    # this rank's part is looked at, the size and type are the whole buffer's
    assert subnormals.likely(normal, found[:1000])
    assert not subnormals.likely(found[: subnormals.MIN_ELEMENTS - 1])  # (too small)
    assert not subnormals.likely(found.astype(np.float64))  # (float32 only)
    assert not subnormals.likely(np.full(2 * size, TINY, np.float32)[::2])  # (contiguous only)
    subnormals._THRESHOLD[0] = float("inf")  # a CPU where subnormals cost nothing extra
    assert not any(subnormals.likely(found) for _ in range(2 * subnormals.RECHECK))


def test_scale_goes_through_float64_only_for_large_buffers_with_subnormals(
    monkeypatch, pays_from_a_tenth
):
    calls = []
    monkeypatch.setattr(subnormals, "multiply", lambda flat, f: calls.append(flat.size))
    big = np.full(subnormals.MIN_ELEMENTS, TINY * 3, np.float32)
    assert any(subnormals.likely(big) for _ in range(subnormals.RECHECK))  # (its turn)
    alg.scale(big, 0.5)
    alg.scale(np.full(subnormals.MIN_ELEMENTS - 1, TINY * 3, np.float32), 0.5)  # too small
    alg.scale(big.astype(np.float64), 0.5)  # (float32 only)
    alg.scale(np.ones(subnormals.MIN_ELEMENTS, np.float32), 0.5)  # none found
    assert calls == [subnormals.MIN_ELEMENTS]
    strided = np.full(2 * subnormals.MIN_ELEMENTS, TINY * 3, np.float32)[::2]
    alg.scale(strided, 0.5, True)  # (not contiguous: in float32, in place all the same)
    assert calls == [subnormals.MIN_ELEMENTS]
    assert strided.tobytes() == np.full(strided.size, TINY * 3 * np.float32(0.5)).tobytes()


@pytest.mark.parametrize(
    "post", [0.5, alg.Finish(1.0, 3), alg.Finish(0.7, 6)], ids=["half", "third", "scaled-sixth"]
)
def test_scale_gives_the_same_bits_either_way(post):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(subnormals.MIN_ELEMENTS) * 1e-3).astype(np.float32)
    x[rng.random(x.size) < 0.35] = TINY * 7
    narrow, wide, looked = x.copy(), x.copy(), x.copy()
    alg.scale(narrow, post, False)
    alg.scale(wide, post, True)
    alg.scale(looked, post)
    assert narrow.tobytes() == wide.tobytes() == looked.tobytes()


def exact_data(rank: int, size: int) -> np.ndarray:
    """A third of the values subnormal (multiples of the least subnormal), the rest multiples
    of 1/8: sums over a few ranks are exact, so any algorithm's order gives the same sum."""
    rng = np.random.default_rng(rank)
    x = (rng.integers(-64, 65, size) / 8).astype(np.float32)
    tiny = np.arange(size) % 3 == 0
    x[tiny] = rng.integers(-(1 << 20), 1 << 20, int(tiny.sum())).astype(np.float32) * TINY
    return x


@pytest.mark.parametrize("n", [2, 3])
def test_average_of_subnormal_gradients_is_the_correctly_rounded_quotient(n, pays_from_a_tenth):
    size = 600_000  # (a 2.4 MB bucket: the ring, looked at for subnormals)

    def body(rank):
        wide = []  # the blocks scaled through float64 (2 ranks multiply by 1/2, 3 divide by 3)
        for fn in ("multiply", "divide"):
            real = getattr(subnormals, fn)
            setattr(subnormals, fn, lambda flat, f, real=real: (wide.append(1), real(flat, f)))
        x = exact_data(rank, size)
        # (a rank process may have inherited the schedule of a test before: from the next
        # buffer that is looked at on, every one is)
        assert any(subnormals.likely(x) for _ in range(subnormals.RECHECK))
        results = [hvd.allreduce(x, op=hvd.Average, name="avg.subnormal") for _ in range(3)]
        return results, len(wide)

    total = np.sum([exact_data(r, size).astype(np.float64) for r in range(n)], 0)
    want = (total / n).astype(np.float32)
    assert np.count_nonzero(np.abs(want) < np.finfo(np.float32).smallest_normal) > size // 4
    for rank, (got, wide) in enumerate(run_ranks(body, n)):
        for call, res in enumerate(got):
            assert res.tobytes() == want.tobytes(), (rank, call)
        assert wide >= 3, rank  # every call's average went through float64


def test_the_average_benchmark_compares_a_baseline_checkout(tmp_path):
    """``horovod.benchmarks.average`` times Average allreduces (with a third of the values
    subnormal in some rows) in jobs of this checkout and of a baseline's, alternating (here the
    baseline is a copy of this one), and prints their ratio."""
    import shutil

    from conftest import REPO, run_module

    from horovod.benchmarks.average import ROWS, label

    shutil.copytree(REPO / "horovod", tmp_path / "horovod")
    r = run_module(
        "horovod.benchmarks.average", "--quick", "--repeats", "1", "--baseline", str(tmp_path)
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for nbytes, subnormal in ROWS:
        row = next(
            ln for ln in r.stdout.splitlines() if ln.startswith(f"| {label(nbytes, subnormal)} |")
        )
        assert row.rstrip(" |").endswith("x") and row.count("|") == 5, row
