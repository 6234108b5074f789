"""Horovod process sets: the optimizer averages over its ``process_set`` alone, and a rank
outside it steps alone, as Horovod's own optimizer does there."""
import pytest

from tests.checks import assert_same_params
from tests.scenarios import scenario
from tests.worlds import DEFAULT_ENV, shared_suite

sets = shared_suite("tests.workers_process_sets:suite", np=4, timeout=180,
                    env={**DEFAULT_ENV, "HOROVOD_DYNAMIC_PROCESS_SETS": "1"})


@pytest.mark.multirank
def test_two_process_sets_train_apart_each_alike_inside(sets):
    runs = scenario(sets, "two_sets")
    for rank, r in enumerate(runs):
        peer = runs[rank ^ 1]
        assert r["phase"] == "compression" and r["bytes"] > 0, \
            f"rank {rank}: phase {r['phase']}, {r['bytes']} bytes sent"
        assert_same_params(r["params"], peer["params"], f"rank {rank} vs rank {rank ^ 1}, its set")
    assert runs[0]["params"] != runs[2]["params"], "the two sets ended alike on other batches"


@pytest.mark.multirank
def test_a_rank_outside_the_process_set_steps_alone_as_plain_adam(sets):
    """All four ranks build the optimizer on the set of ranks 0 and 1: those two train as they
    do without the others, and ranks 2 and 3 take torch.optim.Adam's steps on their own
    gradients, sending nothing."""
    runs, alone = scenario(sets, "outside"), scenario(sets, "two_sets")
    for rank in (0, 1):
        assert_same_params(runs[rank]["params"], alone[rank]["params"],
                           f"rank {rank}: beside ranks outside its set vs beside another set")
    for rank in (2, 3):
        r = runs[rank]
        assert r["bytes"] == 0, f"rank {rank}, outside the set, sent {r['bytes']} bytes"
        assert_same_params(r["params"], r["plain"], f"rank {rank}, outside the set, vs Adam")


@pytest.mark.multirank
def test_the_torch_transport_with_a_process_set_is_refused(sets):
    for rank, error in enumerate(scenario(sets, "torch_transport")):
        assert error is not None and "with a process set use transport='horovod'" in error, \
            f"rank {rank}: transport='torch' on a process set gave {error!r}"


@pytest.mark.multirank
def test_hierarchical_on_a_process_set_stays_flat_or_is_refused(sets):
    """The nodes' layout is read over every Horovod rank, which ranks outside the set do not
    join: "auto" trains flat, as without it (the same bits), and True is refused when the
    optimizer is built, on every rank, instead of waiting at the freeze."""
    flat, auto = scenario(sets, "two_sets"), scenario(sets, "hierarchical_auto")
    for rank, (r, refused) in enumerate(zip(auto, scenario(sets, "hierarchical_true"))):
        assert r["phase"] == "compression", f"rank {rank}: hierarchical='auto' ended {r['phase']}"
        assert_same_params(r["params"], flat[rank]["params"], f"rank {rank}: auto vs flat")
        assert refused is not None and "averages over a process set" in refused, \
            f"rank {rank}: hierarchical=True on a process set gave {refused!r}"


@pytest.mark.multirank
def test_a_removed_process_set_is_refused_naming_it(sets):
    for rank, error in enumerate(scenario(sets, "removed")):
        assert error is not None and "not registered with Horovod" in error, \
            f"rank {rank}: a removed process set gave {error!r}"
