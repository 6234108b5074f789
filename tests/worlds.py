"""Shared multi-rank jobs: one job per world runs every test module's suite that needs it.

Launching a Horovod job costs seconds of start-up (horovodrun, then torch and Horovod imported
on every rank), more than most suites take to run. So a test module does not launch its suite
itself; it declares it::

    results = shared_suite("tests.workers_safety:suite", np=2, timeout=400)

``results`` is then a module-scoped fixture whose value is the suite's return value on every
rank, in rank order (as :func:`hvd_onebit_tools.cluster.jobs.run_ranks` gives it). The first
fixture of a session that needs a world (a rank count, a controller, an environment, hosts and a
stage: :class:`World`) launches that world's job once, for every suite declared for it by the
test modules that have a selected test using their fixture (``pytest tests/test_safety.py`` runs
only safety's suites); the other fixtures of that world take their results from it.

In the job, :func:`run_suites` calls the suites one after the other in every rank; a suite that
raises comes back as its traceback, so only the tests of that suite fail (and inside a suite,
:mod:`tests.scenarios` isolates each scenario the same way). What this cannot isolate: a suite
that hangs (or raises on some ranks while the others wait in a collective) holds up the whole
job until its timeout, the sum of its suites' own timeouts; every process of the job is then
killed, and every test of that world fails with the job's error.

Suites share their ranks' process: one that changes process-wide state (environment variables,
torch's default dtype) must restore it, as a scenario does. torch.distributed's group, once a
suite has set it up, serves the suites after it; a suite that needs it not set up runs first
(``order=-1``). A suite that needs another environment, launcher or hosts declares another
:class:`World` (``env=``, ``controller=``, ``hosts=``) and so runs in another job; one that needs
processes of its own launches them itself (``hvd_onebit_tools.cluster.jobs.run_ranks``).
"""
from __future__ import annotations

import importlib
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pytest

#: The ranks' environment unless a suite asks for another: tensor fusion off. With fusion, which
#: gradients share a fused buffer depends on timing, and with more than two ranks that changes the
#: ring's summation order and so the last bits of hvd.DistributedOptimizer's own results from run
#: to run. Unfused, Horovod is deterministic, which the bit-identity tests need.
DEFAULT_ENV = {"HOROVOD_FUSION_THRESHOLD": "0"}
#: The key of a suite that raised, in a rank's results (cf. tests.scenarios.ERROR_KEY).
SUITE_ERROR = "suite_error"


@dataclass(frozen=True)
class World:
    """What the launch fixes for every suite in it.

    Attributes:
        np: the number of ranks.
        controller: "gloo" (horovodrun --gloo), "mpi" (mpirun) or "torchrun" (torchrun's ranks
            with a Gloo group and no Horovod: :mod:`tests.torchrun_jobs`).
        env: environment variables of the ranks, as sorted (name, value) pairs.
        hosts: "h1:2,h2:2": horovodrun over these hosts (names of this machine stand for
            nodes); None: this machine as one host.
        stage: a world of stage 1 is launched only after the selected worlds of stage 0 whose
            suites name a :class:`Scratch` its suites name (every earlier world where its
            suites name none): a suite of stage 1 reads what suites of stage 0 wrote there (a
            checkpoint resumed by new processes). Worlds it does not read from keep their own
            time, so each module's durations stay its own.
    """

    np: int
    controller: str = "gloo"
    env: tuple[tuple[str, str], ...] = ()
    hosts: Optional[str] = None
    stage: int = 0

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env)
        return (f"{self.np} rank(s), {self.controller}, stage {self.stage}"
                + (f", hosts {self.hosts}" if self.hosts else "") + (f", {env}" if env else ""))


@dataclass(frozen=True)
class Scratch:
    """A folder for suites to share, named: a kwargs value (at any depth) that the launch
    replaces by the folder's path (or by the path of ``file`` in it), the same folder for every
    suite of the session that names it. Its test finds it with :func:`scratch_path`."""

    name: str
    file: str = ""


def scratch_path(factory: pytest.TempPathFactory, scratch: Scratch) -> Path:
    """The folder (or file) ``scratch`` stands for in this session; the folder is made if
    missing."""
    path = factory.getbasetemp() / "worlds" / scratch.name
    path.mkdir(parents=True, exist_ok=True)
    return path / scratch.file if scratch.file else path


def _with_paths(value: Any, factory: pytest.TempPathFactory) -> Any:
    if isinstance(value, Scratch):
        return str(scratch_path(factory, value))
    if isinstance(value, dict):
        return {k: _with_paths(v, factory) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_with_paths(v, factory) for v in value)
    return value


@dataclass(frozen=True)
class Suite:
    """One module's suite in a world.

    Attributes:
        key: unique name of the suite ("tests.test_safety:results" or, for a fixture
            parametrized by rank count, "tests.test_optimizer:world[2]").
        target: "module:function" called in every rank; returns that rank's data.
        world: the job it runs in.
        kwargs: keyword arguments of ``target`` (:class:`Scratch` values become folders).
        timeout: seconds the suite may take, launch included (as it would alone).
        module: the test module that declared it.
        fixture: the name of its fixture in that module.
        param: the fixture's parameter selecting this suite (None when not parametrized).
        order: the suites of a job run by ``order``, then as declared (modules in import order).
    """

    key: str
    target: str
    world: World
    kwargs: tuple[tuple[str, Any], ...]
    timeout: float
    module: str
    fixture: str
    param: Any = None
    order: int = 0


@dataclass
class _Registry:
    """Every declared suite, and each world's job once it has run: ``{"keys": suites in it,
    "results": per rank}`` or ``{"keys": ..., "error": message}``."""

    suites: list[Suite] = field(default_factory=list)
    jobs: dict[World, dict] = field(default_factory=dict)
    #: suites of imported modules not yet declared: (the fixture's suite_for, its parameters)
    pending: list = field(default_factory=list)


_REGISTRY = _Registry()


def _selected(suite: Suite, items: Sequence[pytest.Item]) -> bool:
    """Whether a selected test uses ``suite``'s fixture (with ``suite``'s parameter)."""
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", None)
        if module != suite.module or suite.fixture not in getattr(item, "fixturenames", ()):
            continue
        if suite.param is None:
            return True
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get(suite.fixture) == suite.param:
            return True
    return False


def _scratch_names(value: Any) -> set[str]:
    """The names of the :class:`Scratch` values in ``value``, at any depth."""
    if isinstance(value, Scratch):
        return {value.name}
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return set().union(*(_scratch_names(v) for v in value))
    return set()


def earlier_worlds(selected: Sequence[Suite], world: World) -> list[World]:
    """The worlds of earlier stages that must run before ``world``: those of the ``selected``
    suites whose :class:`Scratch` folders ``world``'s suites name too, or every earlier one
    where ``world``'s suites name none."""
    reads = set().union(*(_scratch_names(dict(s.kwargs)) for s in selected if s.world == world))
    return list(dict.fromkeys(
        s.world for s in selected if s.world.stage < world.stage
        and (not reads or reads & _scratch_names(dict(s.kwargs)))))


def _launch(world: World, request: pytest.FixtureRequest, suites_only=None) -> dict:
    """Run ``world``'s job for every selected suite declared for it (or only the suites keyed
    ``suites_only``), after the jobs of the earlier stages; return ``{"keys": the suites run,
    "results": per rank}`` or ``{"keys": ..., "error": message}``."""
    from hvd_onebit_tools.cluster.jobs import RankFailure, run_job

    _declare_pending()
    selected = [s for s in _REGISTRY.suites if _selected(s, request.session.items)]
    for earlier in earlier_worlds(selected, world):
        if earlier not in _REGISTRY.jobs:
            _REGISTRY.jobs[earlier] = _launch(earlier, request)
    suites = [s for s in selected if s.world == world]
    if suites_only is not None:
        suites = [s for s in _REGISTRY.suites if s.key in suites_only]
    suites.sort(key=lambda s: s.order)  # stable: as declared within an order
    if not suites:  # none selected (a fixture asked for outside pytest's selection): no job
        return {"keys": [], "results": [{} for _ in range(world.np)]}
    factory = request.getfixturevalue("tmp_path_factory")
    calls = [(s.key, s.target, _with_paths(dict(s.kwargs), factory)) for s in suites]
    timeout, env = sum(s.timeout for s in suites), dict(world.env) or None
    try:
        if world.controller == "torchrun":
            from tests.torchrun_jobs import run_torchrun_job

            job = run_torchrun_job("tests.worlds:run_suites", np=world.np,
                                   kwargs={"calls": calls}, timeout=timeout, env=env)
        else:
            job = run_job("tests.worlds:run_suites", np=world.np, controller=world.controller,
                          kwargs={"calls": calls}, timeout=timeout, env=env, hosts=world.hosts)
        return {"keys": [s.key for s in suites], "results": job.results}
    except RankFailure as exc:
        return {"keys": [s.key for s in suites],
                "error": f"the shared job of {world.describe()} for {[s.key for s in suites]} "
                         f"failed:\n{exc}"}


def _results(suite: Suite, request: pytest.FixtureRequest) -> list:
    world = suite.world
    if world not in _REGISTRY.jobs:
        _REGISTRY.jobs[world] = _launch(world, request)
    job = _REGISTRY.jobs[world]
    if suite.key not in job["keys"]:  # not selected when its world ran: a job of its own
        job = _launch(world, request, suites_only={suite.key})
    if "error" in job:
        pytest.fail(job["error"], pytrace=False)
    per_rank = [r[suite.key] for r in job["results"]]
    problems = [f"rank {rank}: {suite.target} raised:\n{r[SUITE_ERROR]}"
                for rank, r in enumerate(per_rank) if isinstance(r, dict) and SUITE_ERROR in r]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    return per_rank


def shared_suite(target: str, np: int | Sequence[int] = 2, *, timeout: float,
                 kwargs: Optional[Mapping[str, Any]] = None,
                 controller: str | Sequence[str] = "gloo",
                 env: Optional[Mapping[str, str]] = None, hosts: Optional[str] = None,
                 stage: int = 0, order: int = 0, name: Optional[str] = None):
    """A module-scoped fixture giving ``target``'s result on every rank of a shared job.

    Args:
        target: "module:function" run in every rank after hvd.init().
        np: the rank count, or several: the fixture is then parametrized by it and gives
            ``(n, results)``, as a module's ``world`` fixture does.
        timeout: seconds the suite may take on its own; a world's job gets the sum of its suites'.
        kwargs: keyword arguments of ``target``, or ``{n: kwargs}`` when ``np`` has several
            counts; a :class:`Scratch` value becomes its folder's path.
        controller: "gloo", "mpi" or "torchrun": part of the world; or several: the fixture is then
            parametrized by ``(controller, n)`` for each controller and count (ids "n-controller")
            and gives ``((controller, n), results)``.
        env: environment variables of the ranks (default :data:`DEFAULT_ENV`): part of the
            world, so suites with another environment run in another job.
        hosts: part of the world: horovodrun over these hosts ("127.0.0.1:2,127.1:2").
        stage: part of the world: 1 for a suite that needs what suites of stage 0 left in a
            :class:`Scratch` folder (its job starts after theirs).
        order: where the suite runs in its job: before the suites of a higher order (-1: first,
            e.g. before any suite sets up torch.distributed in the ranks' process).
        name: the fixture's name in the declaring module (default: the name it is assigned to,
            read from the module after import; pass it when the fixture is not a module global).
    """
    module = sys._getframe(1).f_globals["__name__"]
    counts = [np] if isinstance(np, int) else list(np)
    by_controller = not isinstance(controller, str)
    controllers = list(controller) if by_controller else [controller]
    # the fixture's parameters: a count, or (controller, count); None: not parametrized
    params = ([(c, n) for c in controllers for n in counts] if by_controller
              else counts if not isinstance(np, int) else [None])
    world_env = tuple(sorted((DEFAULT_ENV if env is None else env).items()))

    def suite_for(param) -> Suite:
        fixture = name or _fixture_name(module, fixture_fn)
        c, n = param if by_controller else (controllers[0], counts[0] if param is None else param)
        args = (kwargs or {}).get(param, {}) if param is not None else (kwargs or {})
        key = f"{module}:{fixture}" + ("" if param is None else f"[{param}]")
        for s in _REGISTRY.suites:
            if s.key == key:
                return s
        suite = Suite(key, target, World(n, c, world_env, hosts, stage),
                      tuple(sorted(args.items())), timeout, module, fixture, param, order)
        _REGISTRY.suites.append(suite)
        return suite

    @pytest.fixture(scope="module", params=None if params == [None] else params,
                    ids=(lambda p: f"{p[1]}-{p[0]}") if by_controller else None)
    def fixture_fn(request):
        param = getattr(request, "param", None)
        per_rank = _results(suite_for(param), request)
        return per_rank if param is None else (param, per_rank)

    _REGISTRY.pending.append((suite_for, params))
    return fixture_fn


def _fixture_name(module: str, fixture_fn) -> str:
    for attr, value in vars(sys.modules[module]).items():
        if value is fixture_fn:
            return attr
    raise LookupError(f"the shared_suite fixture of {module} is not a module global: pass name=")


def _declare_pending() -> None:
    """Declare the suites of every imported test module. Collection imports every module before
    the first test runs, so the first job launched knows every suite of its world."""
    while _REGISTRY.pending:
        suite_for, params = _REGISTRY.pending.pop(0)
        for param in params:
            suite_for(param)


# ---------------------------------------------------------------------------------- worker side


def run_suites(calls: list[tuple[str, str, dict]]) -> dict:
    """In every rank: ``{key: target(**kwargs)}`` for each call, in order; a suite that raises
    gives ``{"suite_error": traceback text}`` and the next one runs."""
    out = {}
    for key, target, kwargs in calls:
        module, function = target.split(":")
        try:
            out[key] = getattr(importlib.import_module(module), function)(**kwargs)
        except Exception:  # noqa: BLE001 - a failing suite is its own tests' failure, as data
            out[key] = {SUITE_ERROR: traceback.format_exc()}
    return out
