"""Simulator semantics on graphs whose answer is known, and C++/Python parity on random problems."""

from __future__ import annotations

import numpy as np
import pytest
from plan_cases import GB, actor_problem, frozen_problem, opt, random_choice, random_problem

from rlflow.planner.compiled import compile_problem
from rlflow.planner.plan import ExecutionPlan
from rlflow.planner.problem import ModelEntry, PlanProblem
from rlflow.planner.simulate import Simulator, simulate, simulate_py
from rlflow.strategy import ParallelStrategy

BACKENDS = ["python", "cpp"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_disjoint_meshes_overlap_and_overlapping_meshes_serialize(backend):
    disjoint = frozen_problem([[opt(0, 4, 2.0)], [opt(4, 4, 3.0)]], num_iterations=1)
    overlapping = frozen_problem([[opt(0, 4, 2.0)], [opt(2, 2, 3.0)]], num_iterations=1)
    assert simulate(disjoint, [0, 0], backend=backend).total_time_s == pytest.approx(3.0)  # max(2, 3)
    assert simulate(overlapping, [0, 0], backend=backend).total_time_s == pytest.approx(5.0)  # 2 + 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_steady_state_period_over_unrolled_iterations(backend):
    # Independent calls: each device block runs its own call back to back, iteration t ends at 3(t+1).
    problem = frozen_problem([[opt(0, 4, 2.0)], [opt(4, 4, 3.0)]], num_iterations=3)
    r = simulate(problem, [0, 0], backend=backend)
    assert r.iteration_end_s == pytest.approx((3.0, 6.0, 9.0))
    assert r.iteration_time_s == pytest.approx(3.0) and r.total_time_s == pytest.approx(9.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_version_edge_stops_the_next_iteration_from_overlapping(backend):
    options = [[opt(0, 4, 1.0)], [opt(4, 4, 2.0)]]
    pipelined = frozen_problem(options, data_edges=[(0, 1)], data_time=[np.zeros((1, 1))])
    # MFC 0 of iteration t+1 overlaps MFC 1 of iteration t: the period is the slower call.
    assert simulate(pipelined, [0, 0], backend=backend).iteration_time_s == pytest.approx(2.0)
    serial = frozen_problem(options, data_edges=[(0, 1)], data_time=[np.zeros((1, 1))], version_edges=[(1, 0)])
    assert simulate(serial, [0, 0], backend=backend).iteration_time_s == pytest.approx(3.0)


def _actor(**kw) -> PlanProblem:
    tp4 = ParallelStrategy(dp=1, tp=4)
    gen = [opt(0, 4, 1.0, tp4), opt(0, 8, 0.5, ParallelStrategy(dp=2, tp=4))]
    train = [opt(0, 4, 2.0, tp4)]
    return actor_problem(gen, train, realloc=[[0.0, 0.25]], **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reallocation_node_runs_before_a_call_on_another_layout(backend):
    problem = _actor(data=[[0.0], [0.1]])
    same = simulate(problem, [0, 0], backend=backend)
    assert same.iteration_time_s == pytest.approx(3.0)  # gen 1 + train 2, no reallocation
    assert [n.kind for n in same.nodes if n.iteration == 0] == ["call", "call"]
    moved = simulate(problem, [1, 0], backend=backend)
    assert moved.iteration_time_s == pytest.approx(0.25 + 0.5 + 0.1 + 2.0)
    first = [n for n in moved.nodes if n.iteration == 0]
    assert [n.kind for n in first] == ["realloc", "call", "data", "call"]
    assert first[0].devices == tuple(range(8)) and first[0].source_mfc == 1  # union of home and gen meshes


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_is_static_plus_peak_dynamic(backend):
    tp4 = ParallelStrategy(dp=1, tp=4)
    problem = PlanProblem(
        num_nodes=1,
        devices_per_node=8,
        device_memory_bytes=50 * GB,
        mfc_names=["actor_gen", "actor_train", "ref_inf"],
        mfc_models=[0, 0, 1],
        options=[
            [opt(0, 8, 1.0, ParallelStrategy(dp=2, tp=4), act=7 * GB, weight=5 * GB)],
            [opt(0, 4, 2.0, tp4, act=5 * GB, weight=10 * GB, state=20 * GB)],
            [opt(4, 4, 1.0, tp4, act=3 * GB, weight=8 * GB)],
        ],
        models=[ModelEntry("actor", True, train_mfc=1), ModelEntry("ref", False)],
        realloc_time={(1, 0): np.array([[0.5]])},
    )
    r = simulate(problem, [0, 0, 0], backend=backend)
    # devices 0-3: static 10 + 20 (home), dynamic max(train 5, gen 7 + copy 5); devices 4-7: ref 8 + 12.
    np.testing.assert_allclose(r.static_bytes, [30 * GB] * 4 + [8 * GB] * 4)
    np.testing.assert_allclose(r.peak_bytes, [42 * GB] * 4 + [20 * GB] * 4)
    assert r.fits and r.cost == pytest.approx(r.iteration_time_s)
    small = PlanProblem(**{**problem.__dict__, "device_memory_bytes": 40 * GB})
    tight = simulate(small, [0, 0, 0], penalty=1e3, backend=backend)
    assert not tight.fits and tight.cost == pytest.approx(1e3 * tight.iteration_time_s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_model_is_reloaded_only_when_its_calls_move(backend):
    tp4 = ParallelStrategy(dp=1, tp=4)
    problem = PlanProblem(
        num_nodes=1,
        devices_per_node=8,
        device_memory_bytes=80 * GB,
        mfc_names=["ref_a", "ref_b"],
        mfc_models=[0, 0],
        options=[
            [opt(0, 4, 1.0, tp4, weight=6 * GB)],
            [opt(0, 4, 1.0, tp4, weight=6 * GB), opt(4, 4, 1.0, tp4, weight=6 * GB)],
        ],
        models=[ModelEntry("ref", False)],
        reload_time={0: np.array([0.3]), 1: np.array([0.3, 0.4])},
        num_iterations=1,
    )
    resident = simulate(problem, [0, 0], backend=backend)
    assert resident.total_time_s == pytest.approx(2.0) and resident.static_bytes[0] == pytest.approx(6 * GB)
    moved = simulate(problem, [0, 1], backend=backend)
    assert moved.total_time_s == pytest.approx(1.4)  # reload + call on each block, in parallel: max(1.3, 1.4)
    assert moved.static_bytes.max() == 0 and moved.peak_bytes.max() == pytest.approx(6 * GB)
    assert sorted(n.kind for n in moved.nodes) == ["call", "call", "reload", "reload"]


def _ema(realloc: float | None = None, **kw) -> PlanProblem:
    """Actor trains on devices 0-3 (2 s), the reference runs on 4-7 (1 s) after an EMA blend of 0.5 s."""
    tp4 = ParallelStrategy(dp=1, tp=4)
    names, models, mfc_models = (
        ["actor_train", "ref_inf"],
        [ModelEntry("actor", True, 0), ModelEntry("ref", False)],
        [0, 1],
    )
    options = [[opt(0, 4, 2.0, tp4)], [opt(4, 4, 1.0, tp4)]]
    extra = {}
    if realloc is not None:  # the actor also generates on devices 4-7 before the reference runs
        names, mfc_models = names + ["actor_gen"], mfc_models + [0]
        options.append([opt(4, 4, 1.0, tp4, weight=GB)])
        extra = {
            "realloc_time": {(0, 2): np.array([[realloc]])},
            "data_edges": [(2, 1)],
            "data_time": [np.zeros((1, 1))],
        }
    return PlanProblem(
        num_nodes=1, devices_per_node=8, device_memory_bytes=80 * GB, mfc_names=names, mfc_models=mfc_models,
        options=options, models=models, hook_time={(0, 1): np.array([[0.5]])}, num_iterations=1, **extra, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_ema_blend_runs_before_its_call_on_both_meshes(backend):
    r = simulate(_ema(), [0, 0], backend=backend)
    # the blend waits for the actor's devices (0-3) to be free, then the reference runs
    assert r.total_time_s == pytest.approx(2.0 + 0.5 + 1.0)
    assert [(n.kind, n.devices, n.source_mfc) for n in r.nodes] == [
        ("call", (0, 1, 2, 3), None), ("ema", tuple(range(8)), 0), ("call", (4, 5, 6, 7), None)
    ]  # fmt: skip
    assert r.peak_bytes.max() == 0  # a blend holds no extra copy in the memory model
    plan = ExecutionPlan.from_choice(_ema(), [0, 0])
    assert [(t.kind, t.target, t.source, t.time_s, t.devices) for t in plan.transfers] == [
        ("ema", "ref_inf", "actor_train", 0.5, ((0, 3), (4, 7)))
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reallocation_and_an_ema_blend_share_the_pre_node(backend):
    problem = _ema(realloc=0.25)
    r = simulate(problem, [0, 0, 0], backend=backend)
    gen = next(n for n in r.nodes if n.kind == "realloc")  # gen's realloc: 2.0 .. 2.25, gen 2.25 .. 3.25
    assert (gen.start_s, gen.end_s) == pytest.approx((2.0, 2.25))
    assert r.total_time_s == pytest.approx(3.25 + 0.5 + 1.0)
    with pytest.raises(ValueError, match=r"hook_time\[0,1\] has shape \(1, 1\), expected \(1, 2\)"):
        two = [opt(4, 4, 1.0, ParallelStrategy(dp=1, tp=4))] * 2
        PlanProblem(**{**_ema().__dict__, "options": [_ema().options[0], two]})


def test_bad_problem_and_plan_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="realloc_time lacks"):
        compile_problem(_actor().__class__(**{**_actor().__dict__, "realloc_time": {}}))
    with pytest.raises(ValueError, match="cycle"):
        cyclic = frozen_problem([[opt(0, 1, 1.0)]] * 2, data_edges=[(0, 1), (1, 0)], data_time=[np.zeros((1, 1))] * 2)
        compile_problem(cyclic)
    with pytest.raises(ValueError, match="outside"):
        simulate_py(_actor(), [2, 0])
    with pytest.raises(ValueError, match="one option index per MFC"):
        Simulator(_actor()).cost([0])


def _assert_same(a, b):
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s, rel=1e-9, abs=1e-12)
    assert a.total_time_s == pytest.approx(b.total_time_s, rel=1e-9)
    np.testing.assert_allclose(a.iteration_end_s, b.iteration_end_s, rtol=1e-9)
    np.testing.assert_allclose(a.peak_bytes, b.peak_bytes, rtol=1e-9)
    np.testing.assert_allclose(a.static_bytes, b.static_bytes, rtol=1e-9)
    assert a.fits == b.fits and a.cost == pytest.approx(b.cost, rel=1e-9)
    assert [(n.kind, n.mfc, n.iteration, n.devices) for n in a.nodes] == [
        (n.kind, n.mfc, n.iteration, n.devices) for n in b.nodes
    ]
    np.testing.assert_allclose(
        [(n.start_s, n.end_s) for n in a.nodes], [(n.start_s, n.end_s) for n in b.nodes], rtol=1e-9
    )


def test_cpp_matches_python_on_random_problems_and_plans():
    rng = np.random.default_rng(0)
    checked = hooked = 0
    for _ in range(60):
        problem = random_problem(rng)
        cp = compile_problem(problem)
        hooked += int((cp.hook_src >= 0).sum())
        sim = Simulator(cp, penalty=1e3)
        plans = [random_choice(rng, problem) for _ in range(5)]
        for plan in plans:
            _assert_same(sim.evaluate(plan), simulate_py(cp, plan))
            checked += 1
        np.testing.assert_allclose(
            sim.native.costs(np.array(plans)), [simulate_py(cp, p).cost for p in plans], rtol=1e-9
        )
    assert checked == 300 and hooked > 10  # EMA blends and replicated layouts are among them


def test_cpp_matches_python_beyond_256_devices():
    rng = np.random.default_rng(1)
    problem = random_problem(rng, num_nodes=40, dpn=8)  # 320 devices: five bitset words
    cp, sim = compile_problem(problem), Simulator(problem)
    for _ in range(5):
        plan = random_choice(rng, problem)
        _assert_same(sim.evaluate(plan), simulate_py(cp, plan))
