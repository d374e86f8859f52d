"""The planner at scale: tables stored by dp degree and computed in C++ with the numpy twin's bits,
one price per (mesh shape, strategy), local moves by groups, a 64-GPU PPO problem built in seconds,
and the explanation ``rlflow plan`` prints of why the searched plan beats the heuristic."""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
import pytest
from plan_cases import frozen_problem, opt

from rlflow.cli import main
from rlflow.dataflow import algorithm_graph
from rlflow.planner import build as build_module
from rlflow.planner.baselines import heuristic_plan
from rlflow.planner.build import Workload, build_problem, pricing_rates
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.compiled import _local_moves, compile_problem
from rlflow.planner.cost import call_cost
from rlflow.planner.explain import explain_plan, free_links
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec, model_preset
from rlflow.planner.search import fill_idle_devices, search
from rlflow.planner.simulate import Simulator, simulate_py
from rlflow.planner.space import enumerate_meshes
from rlflow.planner.transfer import data_table, realloc_time_table
from rlflow.strategy import ParallelStrategy

LM = ModelSpec(num_layers=6, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=4, vocab_size=1000)


def _all_options(num_nodes: int, dpn: int, max_pp: int = 4) -> list[tuple[DeviceMesh, ParallelStrategy]]:
    return [
        (m, ParallelStrategy(dp=m.size // (tp * pp), tp=tp, pp=pp))
        for m in enumerate_meshes(num_nodes, dpn)
        for tp in (1, 2, 4)
        for pp in range(1, max_pp + 1)
        if m.num_devices % tp == 0 and m.size % (tp * pp) == 0
    ]


@pytest.mark.parametrize("replicated", [True, False])
def test_realloc_table_in_cpp_has_the_numpy_twins_bits(replicated):
    cluster = cluster_preset("a100-80g", num_nodes=3, devices_per_node=4)
    options = _all_options(3, 4)
    rng = np.random.default_rng(1)
    homes = [options[i] for i in rng.choice(len(options), 40, replace=False)]
    cpp = realloc_time_table(LM, homes, options, cluster, replicated=replicated)
    twin = realloc_time_table(LM, homes, options, cluster, replicated=replicated, backend="numpy", chunk=101)
    assert cpp.shape == (40, len(options)) and np.array_equal(cpp, twin)
    assert (cpp > 0).any() and np.isfinite(cpp).all()


def test_data_table_is_stored_by_dp_degree_and_equals_the_per_pair_formula():
    cluster = cluster_preset("a100-80g", num_nodes=3, devices_per_node=4)
    options = _all_options(3, 4, max_pp=2)
    table = data_table(3e6, options, options, cluster)
    degrees = len({s.dp for _, s in options})
    assert table.seconds.shape == (2, degrees, degrees) and table.shape == (len(options), len(options))
    dense = np.asarray(table)
    for a, b in itertools.product(range(0, len(options), 7), range(0, len(options), 5)):
        (ma, sa), (mb, sb) = options[a], options[b]
        hosts = set(ma.node_ids) | set(mb.node_ids)
        link = cluster.intra_host_bandwidth if len(hosts) == 1 else cluster.inter_host_bandwidth
        send = 3e6 / sa.dp / cluster.host_device_bandwidth
        recv = 3e6 / sb.dp
        expected = cluster.collective_latency_s + send + recv / link + recv / cluster.host_device_bandwidth
        expected = 0.0 if (ma, sa) == (mb, sb) else expected
        assert dense[a, b] == table[a, b] == expected


def test_restricting_a_problem_keeps_its_data_times():
    problem = build_problem(algorithm_graph("ppo"), _models(), cluster_preset("a100-80g", 2), Workload(64, 32, 32))
    keep = {i: list(range(0, len(o), 3)) for i, o in enumerate(problem.options)}
    cut = problem.restricted(keep)
    for (i, k), full, part in zip(problem.data_edges, problem.data_time, cut.data_time):
        assert np.array_equal(np.asarray(part), np.asarray(full)[np.ix_(keep[i], keep[k])])


def _brute_force_moves(opts) -> list[list[int]]:
    """The local moves by their definition, pair by pair."""
    out = []
    for a in opts:
        (la, sa), (da, ta, pa) = (a.mesh.first_device, a.mesh.size), (a.strategy.dp, a.strategy.tp, a.strategy.pp)
        row = []
        for j, b in enumerate(opts):
            (lb, sb), (db, tb, pb) = (b.mesh.first_device, b.mesh.size), (b.strategy.dp, b.strategy.tp, b.strategy.pp)
            factor = (la, sa) == (lb, sb) and (da != db) + (ta != tb) + (pa != pb) == 2
            shifted = sa == sb and la != lb and (da, ta, pa) == (db, tb, pb)
            overlap = la < lb + sb and lb < la + sa
            halved = (sb == 2 * sa and db == 2 * da) or (2 * sb == sa and 2 * db == da)
            nested = (la <= lb and lb + sb <= la + sa) or (lb <= la and la + sa <= lb + sb)
            dpn = a.mesh.devices_per_node
            one_host = sa >= dpn and sb >= dpn and abs(sa - sb) == dpn and db * sa == da * sb and nested
            if factor or shifted or ((ta, pa) == (tb, pb) and ((overlap and halved) or one_host)):
                row.append(j)
        out.append(row)
    return out


def test_local_moves_by_groups_equal_their_pairwise_definition_and_grow_by_one_host():
    opts = [opt(m.first_device, m.size, 1.0, s, dpn=4) for m, s in _all_options(4, 4)]
    moves = _local_moves(opts)
    assert moves == _brute_force_moves(opts)
    three = next(j for j, o in enumerate(opts) if o.mesh.shape == (3, 4) and o.mesh.node_start == 0 and o.strategy.tp == 4 and o.strategy.pp == 1)  # fmt: skip
    reached = {(opts[j].mesh.shape, opts[j].mesh.node_start, opts[j].strategy.dp) for j in moves[three]}
    assert {((4, 4), 0, 4), ((2, 4), 0, 2), ((2, 4), 1, 2)} <= reached


def _models() -> dict[str, ModelSpec]:
    return {"actor": LM, "ref": LM, "critic": LM.as_value_model(), "reward": LM.as_value_model()}


def test_a_64_gpu_ppo_problem_prices_each_shape_once_and_builds_in_seconds(monkeypatch):
    priced = []

    def counting(mfc, model, strategy, mesh, *args):
        priced.append((mfc.name, mesh.shape, strategy))
        return call_cost(mfc, model, strategy, mesh, *args)

    monkeypatch.setattr(build_module, "call_cost", counting)
    llama = model_preset("llama2-7b")
    models = {"actor": llama, "ref": llama, "critic": llama.as_value_model(), "reward": llama.as_value_model()}
    t0 = time.process_time()
    problem = build_problem(algorithm_graph("ppo"), models, cluster_preset("a100-80g", 8), Workload(512, 128, 896))
    cpu_s = time.process_time() - t0
    assert len(priced) == len(set(priced))  # one estimate per (MFC, mesh shape, strategy) ...
    assert len(priced) < sum(map(len, problem.options)) / 4  # ... shared by the meshes' positions
    assert cpu_s < 20.0, f"building the 64-GPU problem took {cpu_s:.1f} CPU s"  # ~1-2 s on a 2-core sandbox
    for (i, k), table in zip(problem.data_edges, problem.data_time):
        assert table.seconds.size <= 2 * 64 * 64  # by dp degree, not by option pair
        assert table.shape == (len(problem.options[i]), len(problem.options[k]))
    sim = Simulator(problem)
    found = search(sim, max_steps=2000, num_chains=1, progress=False)
    assert simulate_py(problem, found.choice).cost == pytest.approx(found.cost, rel=1e-12)


# ----------------------------------------------------------------------------- explaining a plan

CLUSTER_1x8 = cluster_preset("a100-80g", 1)
WORK_1x8 = Workload(64, 128, 256)


@pytest.fixture(scope="module")
def explained():
    graph = algorithm_graph("ppo")
    problem = build_problem(graph, _models(), CLUSTER_1x8, WORK_1x8)
    sim = Simulator(problem)
    heuristic = heuristic_plan(problem, sim)
    found = search(sim, max_steps=3000, num_chains=2, seed=0, initial_plans=[heuristic.choice], progress=False)

    def price(i, option, cluster):
        mfc = graph.nodes[problem.mfc_names[i]]["mfc"]
        model = _models()[mfc.model_name]
        return call_cost(mfc, model, option.strategy, option.mesh, cluster, WORK_1x8, pricing_rates(cluster)).time_s

    cp = sim.compiled
    explanation = explain_plan(
        problem,
        (found.choice, found.result),
        ("heuristic", heuristic.choice, sim.evaluate(heuristic.choice)),
        price,
        CLUSTER_1x8,
        (cp.period_from, cp.period_to),
    )
    return problem, found, heuristic, explanation


def test_explanation_splits_every_call_into_compute_and_communication(explained):
    problem, found, heuristic, ex = explained
    assert [c.mfc for c in ex.calls] == problem.mfc_names
    assert ex.searched_time_s == found.result.iteration_time_s <= ex.reference_time_s == heuristic.iteration_time_s
    for i, c in enumerate(ex.calls):
        assert c.searched_s == problem.options[i][found.choice[i]].time_s
        assert c.reference_s == problem.options[i][heuristic.choice[i]].time_s
        assert 0 <= c.searched_comm_s <= c.searched_s and 0 <= c.reference_comm_s <= c.reference_s
    # The heuristic runs every call at the largest tp of the host: its tp all-reduces are
    # communication that free links remove.
    train = next(c for c in ex.calls if c.mfc == "actor_train")
    assert heuristic.choice is not None and problem.options[4][heuristic.choice[4]].strategy.tp > 1
    assert train.reference_comm_s > 0
    assert free_links(CLUSTER_1x8).inter_host_bandwidth == float("inf")
    assert ex.devices_used <= ex.num_devices == 8 and 0 < ex.searched_busy <= 1


def test_explanation_text_names_the_reference_the_gain_and_each_call(explained):
    _, _, _, ex = explained
    text = ex.to_text()
    gain = ex.reference_time_s / ex.searched_time_s - 1
    assert text.splitlines()[0].startswith(f"why the searched plan is {gain:+.1%} faster than heuristic")
    for c in ex.calls:
        row = next(line for line in text.splitlines() if line.strip().startswith(c.mfc + " "))
        assert ("same" in row) == (c.reference_s == c.searched_s)
        if c.searched_s < c.reference_s:
            assert "faster (compute" in row and "comm" in row
    assert "transfers per iteration, search:" in text and "devices busy" in text


def test_overlaps_are_measured_on_disjoint_devices_in_the_steady_state():
    # Two calls on disjoint halves, each waiting for both of the previous iteration: every iteration
    # they run side by side for the shorter one's time.
    problem = frozen_problem([[opt(0, 4, 2.0)], [opt(4, 4, 3.0)]], num_iterations=3, version_edges=[(0, 1), (1, 0)])
    sim = Simulator(problem)
    result = sim.evaluate([0, 0])
    cp = compile_problem(problem)
    ex = explain_plan(
        problem, ([0, 0], result), ("same", [0, 0], result), lambda i, o, c: o.time_s, CLUSTER_1x8,
        (cp.period_from, cp.period_to),
    )  # fmt: skip
    assert [(o.mfc_a, o.mfc_b) for o in ex.overlaps] == [("m0", "m1")]
    assert ex.overlaps[0].seconds == pytest.approx(2.0)
    assert ex.searched_busy == pytest.approx((2.0 * 4 + 3.0 * 4) / (3.0 * 8))
    assert "m0 with m1 2.00 s" in ex.to_text()


def test_rlflow_plan_prints_the_search_summary_and_the_explanation(capsys):
    argv = "plan --algo ppo --actor llama2-7b --nodes 1 --devices-per-node 4 --batch 64 --prompt-len 128 --gen-len 128 --search-steps 300 --chains 1 --no-progress".split()  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("problem: 6 calls, ") and " options, built in " in text
    assert "plan search: mcmc, 300 proposals" in text
    why = text[text.index("why the searched plan is") :]
    for name in ("actor_gen", "critic_inf", "ref_inf", "reward_inf", "actor_train", "critic_train", "devices busy"):
        assert name in why


def test_rlflow_plan_max_options_keeps_the_fastest_options_of_each_call(capsys):
    argv = "plan --algo ppo --actor llama2-7b --nodes 2 --devices-per-node 4 --batch 64 --prompt-len 128 --gen-len 128 --search-steps 200 --chains 1 --no-progress".split()  # fmt: skip
    assert main([*argv, "--max-options", "5"]) == 0
    assert capsys.readouterr().out.startswith("problem: 6 calls, 30 options, ")
    with pytest.raises(SystemExit):
        main([*argv, "--max-options", "0"])
    assert "--max-options=0 must be >= 1" in capsys.readouterr().err


def test_idle_devices_are_put_to_work_only_where_that_is_faster():
    # MFC 0 may run on devices 0-3, 0-7 (faster) or 4-7; MFC 1 only on 0-3.
    problem = frozen_problem(
        [[opt(0, 4, 2.0), opt(0, 8, 1.5), opt(4, 4, 2.0)], [opt(0, 4, 1.0)]],
        version_edges=[(0, 1), (1, 0)],
    )
    sim = Simulator(problem)
    assert fill_idle_devices(sim, (0, 0)) == ((1, 0), sim.cost((1, 0)))
    assert sim.cost((1, 0)) < sim.cost((0, 0))
    # Where the larger mesh is slower, the idle devices stay idle.
    slower = frozen_problem([[opt(0, 4, 2.0), opt(0, 8, 2.5)]])
    assert fill_idle_devices(Simulator(slower), (0,)) == ((0,), Simulator(slower).cost((0,)))
    # The search ends with the pass: its best plan leaves no device idle that a call could use faster.
    found = search(sim, max_steps=50, num_chains=1, initial_plans=[(0, 0)], progress=False)
    assert found.cost <= fill_idle_devices(sim, found.choice)[1]
    assert "4 idle devices put to work" in dataclasses.replace(found, filled_devices=4).summary()
