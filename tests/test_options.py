"""DistributedOptimizer's options: twelve keywords of its own, the research knobs in one
Experimental object, parsed once into OneBitConfig with the same defaults and the same resolved
values the flat keywords had."""
import dataclasses
import inspect

import pytest
import torch

import hvd_onebit
from hvd_onebit import Experimental
from hvd_onebit.config import AutoFreeze, OneBitConfig
from hvd_onebit.variance_refresh import RefreshSchedule

KEYWORDS = ["freeze_step", "variance_refresh", "hierarchical", "bucket_size_mb", "transport",
            "overlap", "memory", "flush_on_commit", "block_size", "check_every",
            "kernel_backend", "experimental"]

# What OneBitConfig.from_options(10) holds, field by field: the defaults (the refresh: "doubling").
DEFAULTS = {"freeze_step": 10, "compressor": "onebit", "block_size": 512, "transport": "auto",
            "kernel_backend": "auto", "bucket_size_mb": 64.0, "check_every": 0,
            "auto_freeze": None, "flush_on_commit": False, "hierarchical": False,
            "overlap": True, "memory": "auto", "intra_node": "auto", "step_bound": "adam",
            "zero_variance": "hold", "precondition": True, "refresh": RefreshSchedule()}

# Each moved knob: the old keyword's value, and what the config resolved it to then.
MOVED = [
    ("compressor", "none", {"compressor": "none"}),
    ("precondition", False, {"precondition": False}),
    ("step_bound", None, {"step_bound": None}),
    ("step_bound", 3, {"step_bound": 3.0}),
    ("zero_variance", "eps", {"zero_variance": "eps"}),
    ("intra_node", "network", {"intra_node": "network"}),
]


def _fields(config: OneBitConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def test_the_optimizer_takes_twelve_options_of_its_own():
    params = inspect.signature(hvd_onebit.DistributedOptimizer).parameters
    own = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert own == KEYWORDS, f"DistributedOptimizer's keyword-only options: {own}"
    parsed = inspect.signature(OneBitConfig.from_options).parameters
    for name in KEYWORDS[1:]:
        assert params[name].default == parsed[name].default, \
            f"{name}: DistributedOptimizer's default {params[name].default!r}, " \
            f"OneBitConfig.from_options' {parsed[name].default!r}"


def test_no_options_give_the_defaults_field_by_field():
    got = _fields(OneBitConfig.from_options(10))
    assert got == DEFAULTS, f"differs from the defaults: " \
        f"{ {k: (got[k], DEFAULTS.get(k)) for k in got if got[k] != DEFAULTS.get(k)} }"
    auto = OneBitConfig.from_options("auto")
    assert auto.auto_freeze == AutoFreeze(window=10, tolerance=0.1, patience=2, min_steps=50,
                                          max_steps=10000), f"auto: {auto.auto_freeze}"
    doubling = OneBitConfig.from_options(10, variance_refresh="doubling").refresh
    assert doubling == RefreshSchedule(first_interval=1, growth=2, updates_per_interval=16,
                                       last_step=None, variance_update="gap",
                                       error_feedback="rescale"), doubling


@pytest.mark.parametrize("name,value,resolved", MOVED)
def test_each_moved_knob_resolves_as_its_keyword_did(name, value, resolved):
    got = _fields(OneBitConfig.from_options(10, experimental=Experimental(**{name: value})))
    assert got == {**DEFAULTS, **resolved}, f"Experimental({name}={value!r}) gave {got}"
    assert type(got[name]) is type(resolved[name]), f"{name}: {type(got[name])}"


def test_auto_freeze_and_a_schedule_resolve_as_their_dicts_did():
    c = OneBitConfig.from_options("auto", experimental=Experimental(auto_freeze={"min_steps": 5}))
    assert c.auto_freeze == AutoFreeze(min_steps=5), c.auto_freeze
    c = OneBitConfig.from_options(10, variance_refresh="doubling", experimental=Experimental(
        refresh_schedule={"variance_update": "single", "last_step": 90}))
    assert c.refresh == RefreshSchedule(variance_update="single", last_step=90), c.refresh
    schedule = RefreshSchedule(first_interval=4)
    c = OneBitConfig.from_options(10, variance_refresh="doubling",
                                  experimental=Experimental(refresh_schedule=schedule))
    assert c.refresh is schedule


@pytest.mark.parametrize("name,value", [(n, v) for n, v, _ in MOVED]
                         + [("auto_freeze", {"min_steps": 5}),
                            ("refresh_schedule", {"variance_update": "single"})])
def test_a_moved_knob_passed_the_old_way_says_how_to_pass_it(name, value):
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(TypeError) as err:
        hvd_onebit.DistributedOptimizer(torch.optim.Adam(params), freeze_step=3,
                                        **{name: value})
    assert f"experimental=Experimental({name}={value!r})" in str(err.value), str(err.value)


def test_an_unknown_keyword_is_named():
    with pytest.raises(TypeError, match="unexpected keyword argument 'freeze_steps'"):
        OneBitConfig.from_options(3, freeze_steps=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'growth'"):
        Experimental(growth=3)


def test_variance_refresh_takes_a_preset_and_experimental_refines_it():
    with pytest.raises(ValueError, match=r"variance_refresh takes None or 'doubling'.*"
                                         r"refresh_schedule=\{'last_step': 90\}"):
        OneBitConfig.from_options(3, variance_refresh={"last_step": 90})
    with pytest.raises(ValueError, match="variance_refresh must be None or 'doubling', got "
                                         "'weekly'"):
        OneBitConfig.from_options(3, variance_refresh="weekly")
    with pytest.raises(ValueError, match="refresh_schedule refines variance_refresh='doubling'"):
        OneBitConfig.from_options(3, variance_refresh=None,
                                  experimental=Experimental(refresh_schedule={"growth": 4}))
    with pytest.raises(ValueError,
                       match="auto_freeze options apply only with freeze_step='auto'"):
        OneBitConfig.from_options(3, experimental=Experimental(auto_freeze={"window": 5}))


@pytest.mark.parametrize("knobs,message", [
    ({"compressor": "twobit"}, "compressor must be one of"),
    ({"precondition": 1}, "precondition must be True or False, got 1"),
    ({"step_bound": -1}, "step_bound must be 'adam', None or a positive finite number, got -1"),
    ({"zero_variance": "zero"}, "zero_variance must be one of"),
    ({"intra_node": "nvlink"}, "intra_node must be one of"),
    ({"auto_freeze": {"window": 0}}, "auto_freeze window must be a positive int, got 0"),
    ({"refresh_schedule": {"growth": 0}}, "refresh_schedule growth must be a number >= 1"),
])
def test_experimental_names_the_knob_and_the_bad_value(knobs, message):
    with pytest.raises(ValueError, match=message):
        Experimental(**knobs)


@pytest.mark.parametrize("options,message", [
    ({"bucket_size_mb": 0}, "bucket_size_mb must be a positive number of MiB, got 0"),
    ({"check_every": -1}, "check_every must be a non-negative int, got -1"),
    ({"block_size": 12}, "block_size must be None or a positive multiple of 8, got 12"),
    ({"memory": "tiny"}, "memory must be one of"),
    ({"hierarchical": "yes"}, "hierarchical must be True, False or 'auto', got 'yes'"),
    ({"overlap": 1}, "overlap must be True or False, got 1"),
    ({"experimental": {"precondition": False}}, "experimental must be an hvd_onebit"),
])
def test_the_options_name_the_option_and_the_bad_value(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        OneBitConfig.from_options(3, **options)


@pytest.mark.parametrize("options,message", [
    ({"transport": "carrier_pigeon"}, "carrier_pigeon"),
    ({"kernel_backend": "asm"}, "kernel_backend must be one of"),
    ({"hierarchical": True, "transport": "mpi"}, "hierarchical 1-bit runs on transport="),
])
def test_the_options_against_the_job_are_checked_when_the_optimizer_is_built(options, message):
    params = [torch.nn.Parameter(torch.zeros(3))]
    OneBitConfig.from_options(3, **options)  # the config alone does not know the job
    with pytest.raises(ValueError, match=message):
        hvd_onebit.DistributedOptimizer(torch.optim.Adam(params), freeze_step=3, **options)


def test_flush_on_commit_refuses_beta1_zero_when_the_optimizer_is_built():
    """Every commit would fold the errors into a momentum that beta1 = 0 does not carry: the
    first commit raised; now the construction does, naming the group."""
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    adam = torch.optim.Adam([{"params": params[:1]},
                             {"params": params[1:], "betas": (0.0, 0.999)}])
    with pytest.raises(ValueError, match=r"needs beta1 > 0; param group\(s\) \[1\] have "):
        hvd_onebit.DistributedOptimizer(adam, freeze_step=3, flush_on_commit=True)
    from hvd_onebit.phases.setup import check_foldable

    check_foldable([{"betas": (torch.tensor(0.9), 0.999)}])  # beta1 > 0, a tensor too: taken


def test_the_arguments_before_the_options_are_horovods_own_in_its_order():
    """A Horovod script's call, positional or by keyword, binds as it did to
    hvd.DistributedOptimizer: the same names in the same order, with the same defaults."""
    import horovod.torch as hvd

    ours = inspect.signature(hvd_onebit.DistributedOptimizer).parameters
    theirs = inspect.signature(hvd.DistributedOptimizer).parameters
    positional = {n: p.default for n, p in ours.items()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}
    horovod = {n: p.default for n, p in theirs.items()}
    assert list(positional) == list(horovod), \
        f"hvd_onebit's positional arguments {list(positional)}, Horovod's {list(horovod)}"
    differ = {n: (positional[n], horovod[n]) for n in horovod
              if n != "optimizer" and positional[n] != horovod[n]}
    assert not differ, f"defaults that differ (ours, Horovod's): {differ}"


def test_freeze_step_takes_any_integral_count_and_refuses_tensors_and_bools():
    import numpy as np

    for value in (np.int64(3), np.int32(3)):
        got = OneBitConfig.from_options(value).freeze_step
        assert got == 3 and type(got) is int, f"freeze_step={value!r} parsed to {got!r}"
    for value in (torch.tensor(3), True, np.float64(3.0)):
        with pytest.raises(ValueError, match="freeze_step must be a positive int"):
            OneBitConfig.from_options(value)


def test_the_counts_and_sizes_take_numpy_scalars_as_freeze_step_does():
    """A run's numbers computed with numpy (block size, check interval, bucket MiB) read as
    Python's own: they were refused with messages that looked self-contradictory ("must be a
    positive number of MiB, got np.float32(64.0)")."""
    import numpy as np

    config = OneBitConfig.from_options(3, block_size=np.int64(256), check_every=np.int32(10),
                                       bucket_size_mb=np.float32(16.0))
    got = {k: (getattr(config, k), type(getattr(config, k)).__name__)
           for k in ("block_size", "check_every", "bucket_size_mb")}
    assert got == {"block_size": (256, "int"), "check_every": (10, "int"),
                   "bucket_size_mb": (16.0, "float")}, got
    for options, message in (({"block_size": np.float64(512.0)}, "block_size must be None"),
                             ({"check_every": np.bool_(True)}, "check_every must be"),
                             ({"block_size": True}, "block_size must be None")):
        with pytest.raises(ValueError, match=message):
            OneBitConfig.from_options(3, **options)


def test_a_bucket_size_of_a_few_elements_warns_that_the_steps_will_be_slow():
    """bucket_size_mb=1e-6 (a size in another unit) made one-element buckets, a collective
    each in every compressed step, about a thousand times slower, without a word."""
    import warnings

    from hvd_onebit.job import check_options

    with pytest.warns(UserWarning, match=r"bucket_size_mb=1e-06 makes buckets of 1 float32 "
                                         r"element\(s\).*bucket_size_mb is in MiB"):
        check_options(OneBitConfig.from_options(3, bucket_size_mb=1e-6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_options(OneBitConfig.from_options(3, bucket_size_mb=0.001))  # the tests' smallest


def test_hierarchical_auto_stays_flat_on_a_transport_without_the_hierarchical_collective():
    """transport="mpi" has no hierarchical collective: "auto" stays flat there (refused
    before, on one node too, where "auto" is flat anyway), with a warning only where it would
    have turned on; True is still refused."""
    import warnings

    from hvd_onebit.job import check_options
    from hvd_onebit.phases.setup import flat_on_its_transport

    auto = OneBitConfig.from_options(3, transport="mpi", hierarchical="auto")
    check_options(auto)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_node = flat_on_its_transport(auto, several_nodes=False)
    with pytest.warns(UserWarning, match="hierarchical='auto' stays flat: transport='mpi'"):
        nodes = flat_on_its_transport(auto, several_nodes=True)
    kept = flat_on_its_transport(OneBitConfig.from_options(3, hierarchical="auto"), True)
    assert (one_node.hierarchical, nodes.hierarchical, kept.hierarchical) == (False, False,
                                                                             "auto"), \
        (one_node.hierarchical, nodes.hierarchical, kept.hierarchical)
    with pytest.raises(ValueError, match="hierarchical 1-bit runs on transport="):
        check_options(OneBitConfig.from_options(3, transport="mpi", hierarchical=True))


@pytest.mark.parametrize("name, value, says", [
    ("flush_on_commit", True, "opt.flush_error_feedback() before saving"),
    ("transport", "mpi", "travels on torch.distributed"),
    ("backward_passes_per_step", 2, "model.no_sync()"),
    ("named_parameters", [], "the DDP model names its parameters"),
    ("process_set", None, "pass process_group"),
    ("op", "Average", "DDP decides it"),
    ("gradient_predivide_factor", 2.0, "DDP decides it")])
def test_the_ddp_face_refuses_the_horovod_faces_keywords_saying_what_ddp_does(name, value, says):
    """Each keyword only the Horovod face takes is refused by the DDP face before it looks at
    the model, naming the keyword and what a DDP script does instead; none is taken silently."""
    import hvd_onebit.ddp
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(TypeError) as err:
        hvd_onebit.ddp.DistributedOptimizer(torch.optim.Adam(params), None, freeze_step=3,
                                            **{name: value})
    message = str(err.value)
    assert f"takes no {name} (" in message and says in message, \
        f"{name}={value!r}: {message!r}, want it to name {name} and say {says!r}"


class OwnError(ValueError):
    """An exception type that is not a builtin one, derived from one."""


@pytest.mark.parametrize("error, kind", [(ValueError("b" * 5000), ValueError),
                                          (OwnError("own"), ValueError)])
def test_a_refusal_of_another_rank_arrives_as_its_type_and_message_cut_to_the_row(error, kind):
    """The construction's agreement as rank 0 sees it, rank 1's row beside its own: rank 1's
    type, or the nearest builtin one it derives from, and its message, cut to the row's
    bytes."""
    from hvd_onebit.consistency import REFUSAL_BYTES, refusal_row, refused_on_every_rank

    def two_ranks(mine):
        return torch.cat([mine, refusal_row(error)])

    with pytest.raises(Exception) as raised:
        with refused_on_every_rank(lambda: two_ranks, "face"):
            pass
    message = str(raised.value)
    assert type(raised.value) is kind and message.startswith("rank 1 refused to build face: "), \
        f"rank 1's {type(error).__name__} arrived on rank 0 as {type(raised.value).__name__}: " \
        f"{message[:80]!r}"
    text = str(error)
    if len(text) > REFUSAL_BYTES:
        assert message.endswith("b...") and len(message) < REFUSAL_BYTES + 40, \
            f"a message of {len(text)} bytes arrived as {len(message)} characters ending " \
            f"{message[-8:]!r}"
    else:
        assert message.endswith(": " + text), f"rank 1's message arrived as {message!r}"
    with refused_on_every_rank(lambda: lambda mine: torch.cat([mine, refusal_row(None)]), "face"):
        pass  # no rank refused: nothing raised
