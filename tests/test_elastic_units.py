"""Elastic training, piece by piece (no processes): rank assignment and the blacklist, host
discovery, the membership protocol, and the worker states' collective decisions (ranks as
threads)."""

from __future__ import annotations

import random

import numpy as np
import pytest

import horovod.numpy as hvd
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.elastic import ObjectState
from horovod.rendezvous import elastic as protocol
from horovod.rendezvous.store import MemoryStore
from horovod.runner.elastic.discovery import DiscoveryError, ScriptDiscovery, parse_lines
from horovod.runner.elastic.membership import HostBook, change, seats
from horovod.runner.hosts import HostInfo
from horovod.testing import run_ranks


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_seats_fill_hosts_in_order_and_cap_at_max_np():
    s = seats([("a", [0, 1]), ("b", [0, 1, 2])], max_np=4)
    assert [(k, v.rank, v.local_rank, v.local_size) for k, v in s.items()] == [
        ("a:0", 0, 0, 2),
        ("a:1", 1, 1, 2),
        ("b:0", 2, 0, 2),
        ("b:1", 3, 1, 2),
    ]
    assert {v.size for v in s.values()} == {4}
    assert [(v.cross_rank, v.cross_size) for v in s.values()] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_seats_of_surviving_slots_get_consecutive_local_ranks():
    s = seats([("a", [0, 2])], max_np=None)
    assert (s["a:0"].local_rank, s["a:2"].local_rank, s["a:2"].local_size) == (0, 1, 2)


def test_known_hosts_keep_their_place_and_new_ones_go_last():
    book = HostBook()
    book.update([HostInfo("a", 1), HostInfo("b", 1)])
    book.update([HostInfo("c", 1), HostInfo("b", 1), HostInfo("a", 1)])
    assert [h.hostname for h in book.usable()] == ["a", "b", "c"]
    book.update([HostInfo("c", 2)])
    assert [(h.hostname, h.slots) for h in book.usable()] == [("c", 2)]


def test_blacklisted_host_gets_no_new_workers_but_survivors_keep_seats():
    book = HostBook()
    book.update([HostInfo("a", 3), HostInfo("b", 2)])
    book.blacklist("a", "exited with code 1")
    assert book.plan(alive=["a:0", "a:2", "b:0"]) == [("a", [0, 2]), ("b", [0, 1])]
    assert book.plan(alive=[]) == [("b", [0, 1])]
    book.blacklist("b", "killed")
    assert book.all_blacklisted_for_good()


def test_cooldown_doubles_within_its_bounds_and_the_host_comes_back():
    clock = Clock()
    book = HostBook(cooldown=(2.0, 10.0), clock=clock, rng=random.Random(1))
    book.update([HostInfo("a", 1)])
    waits = []
    for _ in range(4):
        book.blacklist("a", "failed")
        left = book.next_resurrection()
        assert left is not None
        waits.append(left)
        assert book.usable() == []
        clock.t += left
        assert [h.hostname for h in book.usable()] == ["a"]
    assert 2.0 <= waits[0] <= 4.0 and 4.0 <= waits[1] <= 6.0 and waits[3] == 10.0
    assert not book.all_blacklisted_for_good()


def test_change_flags():
    assert change(["a:0"], ["a:0"]) == protocol.NO_UPDATE
    assert change(["a:0"], ["a:0", "b:0"]) == protocol.ADDED
    assert change(["a:0", "b:0"], ["a:0"]) == protocol.REMOVED
    assert change(["a:0"], ["b:0"]) == protocol.MIXED


def test_discovery_lines():
    assert parse_lines("a:2\n\n# comment\nb\n", default_slots=3) == [
        HostInfo("a", 2),
        HostInfo("b", 3),
    ]
    assert parse_lines("", None) == []
    with pytest.raises(ValueError, match="--slots"):
        parse_lines("b\n", None)


def test_failing_discovery_script_is_fatal_first_then_keeps_last_answer(tmp_path, capsys):
    flag = tmp_path / "fail"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\n[ -e {flag} ] && {{ echo broken >&2; exit 4; }}\necho a:2\n")
    script.chmod(0o755)
    d = ScriptDiscovery(str(script), None)
    flag.write_text("")
    with pytest.raises(DiscoveryError, match="exit code 4: broken"):
        d.find()
    flag.unlink()
    assert d.find() == [HostInfo("a", 2)]
    flag.write_text("")
    assert d.find() == [HostInfo("a", 2)]
    assert "keeping the last hosts" in capsys.readouterr().err


def test_round_round_trips_and_join_sees_removal_and_timeout():
    store = MemoryStore()
    rnd = protocol.Round(3, seats([("a", [0, 1])], None), update=2)
    assert protocol.Round.decode(rnd.encode()) == rnd
    protocol.publish_round(store, rnd)
    assert protocol.join(store, "a:1", 2, "w7", timeout=1).seats["a:1"].rank == 1
    assert protocol.read_ready(store.get(protocol.SCOPE, "ready.a:1")) == (2, "w7")
    with pytest.raises(protocol.Removed, match="b:0 has been removed"):
        protocol.join(store, "b:0", 2, "w8", timeout=1)
    with pytest.raises(protocol.NoRound, match="formed no round after round 3"):
        protocol.join(store, "a:0", 3, "w9", timeout=0.1)


# ---------------------------------------------------------------------- worker states
def test_object_state_commit_restore_deep_copies():
    def body(rank):
        s = ObjectState(items=[1], epoch=0)
        s.items.append(2)
        s.epoch = 1
        s.commit()
        s.items.append(3)
        s.epoch = 2
        s.restore()
        assert (s.items, s.epoch) == ([1, 2], 1)
        s.items.append(9)
        s.restore()
        return s.items

    assert run_ranks(body, 2) == [[1, 2], [1, 2]]


def test_sync_takes_the_newest_commit_even_when_rank_0_is_new():
    """Upstream #2652: a new worker given rank 0 must not overwrite the survivors' state."""

    def body(rank):
        s = ObjectState(w=0, epoch=0)
        if hvd.rank() != 0:  # ranks 1 and 2 survived three commits; rank 0 is new
            s.w, s.epoch, s.commits = 10 * hvd.rank() + 3, 3, 3
            s.save()
            s.w = -1  # uncommitted work: sync hands over the commit, not this
        s.sync()
        return s.w, s.epoch, s.commits

    assert run_ranks(body, 3) == [(13, 3, 3)] * 3  # rank 1: the lowest of the newest


def test_host_update_heard_by_one_rank_interrupts_every_rank_at_the_same_commit():
    def body(rank):
        s = ObjectState(step=0)
        if hvd.rank() == 2:
            s.on_hosts_updated(5, protocol.REMOVED)
        try:
            s.commit()
        except HostsUpdatedInterrupt as e:
            second = None
            try:
                s.commit()  # the change was taken into account: no second interrupt
            except HostsUpdatedInterrupt:
                second = "again"
            return e.skip_sync, second
        return "no interrupt"

    assert run_ranks(body, 3) == [(True, None)] * 3


def test_added_hosts_need_a_sync():
    def body(rank):
        s = ObjectState(step=0)
        s.on_hosts_updated(1, protocol.REMOVED)
        if hvd.rank() == 0:
            s.on_hosts_updated(2, protocol.ADDED)
        with pytest.raises(HostsUpdatedInterrupt) as e:
            s.check_host_updates()
        return e.value.skip_sync

    assert run_ranks(body, 2) == [False, False]


def test_elastic_run_outside_an_elastic_job_just_runs():
    calls = []

    def body(rank):
        s = ObjectState(x=1)

        @hvd.elastic.run
        def train(state, k):
            calls.append(k)
            state.x += k
            state.commit()
            return state.x

        return train(s, 2)

    assert run_ranks(body, 2) == [3, 3]
    assert calls == [2, 2]


def test_torch_state_handlers_save_restore_and_sync_from_newest():
    torch = pytest.importorskip("torch")

    import horovod.torch as thvd

    def body(rank):
        torch.manual_seed(thvd.rank())
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        sampler = thvd.elastic.ElasticSampler(list(range(20)), shuffle=False)
        state = thvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0)
        if thvd.rank() == 1:  # the survivor: one committed step
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
            sampler.record_batch(0, 2)
            state.epoch = 1
            state.commits += 1
            state.save()  # what commit() does before its (collective) host check
            before = [p.detach().clone() for p in model.parameters()]
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(5.0)  # uncommitted work
            state.restore()
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))
        state.sync()
        return (
            [p.detach().numpy().copy() for p in model.parameters()],
            sorted(opt.state_dict()["state"]),
            sampler.state_dict(),
            state.epoch,
        )

    out = run_ranks(body, 2)
    for a, b in zip(out[0][0], out[1][0], strict=False):
        np.testing.assert_array_equal(a, b)
    assert out[0][1:] == out[1][1:] == ([0, 1], {"epoch": 0, "processed_num": 4}, 1)


@pytest.mark.parametrize("frontend", ["horovod.tensorflow.keras", "horovod.keras"])
def test_keras_state_saves_restores_and_syncs_model_and_optimizer(frontend):
    pytest.importorskip("tensorflow")
    import importlib

    import tensorflow as tf

    hk = importlib.import_module(frontend)
    keras = tf.keras if frontend == "horovod.tensorflow.keras" else importlib.import_module("keras")

    def body(rank):
        model = keras.Sequential([keras.layers.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        state = hk.elastic.KerasState(model, epoch=0)
        if rank == 1:  # the survivor trained and committed; rank 0 is new (no optimizer slots)
            model.train_on_batch(np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32))
            state.epoch = 2
            state.commits += 1
            state.save()
            kept = [w.copy() for w in model.get_weights()]
            model.set_weights([w + 1 for w in kept])  # uncommitted
            state.restore()
            assert all(np.array_equal(a, b) for a, b in zip(kept, model.get_weights(), strict=True))
        state.sync()
        slots = [np.array(v.numpy()) for v in model.optimizer.variables]
        return model.get_weights(), slots, state.epoch

    out = run_ranks(body, 2)
    for a, b in zip(out[0][0] + out[0][1], out[1][0] + out[1][1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert out[0][2] == out[1][2] == 2
