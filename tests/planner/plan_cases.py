"""Hand-built and random :class:`PlanProblem`s for the simulator, search and baseline tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.problem import CallOption, ModelEntry, PlanProblem
from rlflow.strategy import ParallelStrategy

GB = 1e9


def mesh(lo: int, size: int, dpn: int = 8) -> DeviceMesh:
    """The mesh over global devices ``lo .. lo + size - 1``."""
    if size >= dpn:
        return DeviceMesh(size // dpn, dpn, node_start=lo // dpn, device_start=0, devices_per_node=dpn)
    return DeviceMesh(1, size, node_start=lo // dpn, device_start=lo % dpn, devices_per_node=dpn)


def opt(lo, size, time_s, strategy=None, act=0.0, weight=0.0, state=0.0, dpn=8) -> CallOption:
    return CallOption(
        mesh=mesh(lo, size, dpn),
        strategy=strategy or ParallelStrategy(dp=size),
        time_s=time_s,
        act_bytes=act,
        weight_bytes=weight,
        train_state_bytes=state,
    )


def frozen_problem(options: list[list[CallOption]], **kw) -> PlanProblem:
    """One frozen single-call model per MFC: no reallocation, no reload."""
    n = len(options)
    return PlanProblem(
        num_nodes=kw.pop("num_nodes", 1),
        devices_per_node=kw.pop("devices_per_node", 8),
        device_memory_bytes=kw.pop("device_memory_bytes", 80 * GB),
        mfc_names=kw.pop("mfc_names", [f"m{i}" for i in range(n)]),
        mfc_models=list(range(n)),
        options=options,
        models=[ModelEntry(f"model{i}", trainable=False) for i in range(n)],
        **kw,
    )


def actor_problem(gen_options, train_options, realloc, data=None, **kw) -> PlanProblem:
    """A trainable actor: MFC 0 generates, MFC 1 trains (home); gen -> train data edge, train -> gen version edge."""
    data = np.zeros((len(gen_options), len(train_options))) if data is None else np.asarray(data, dtype=float)
    return PlanProblem(
        num_nodes=kw.pop("num_nodes", 1),
        devices_per_node=8,
        device_memory_bytes=kw.pop("device_memory_bytes", 80 * GB),
        mfc_names=["actor_gen", "actor_train"],
        mfc_models=[0, 0],
        options=[gen_options, train_options],
        models=[ModelEntry("actor", trainable=True, train_mfc=1)],
        data_edges=[(0, 1)],
        data_time=[data],
        version_edges=[(1, 0)],
        realloc_time={(1, 0): np.asarray(realloc, dtype=float)},
        **kw,
    )


# ----------------------------------------------------------------------------- random problems


def valid_meshes(num_nodes: int, dpn: int) -> list[tuple[int, int]]:
    """All ``(first_device, size)`` meshes of a cluster (power-of-two sub-host meshes, whole-host runs)."""
    out = []
    size = 1
    while size < dpn:
        out += [(n * dpn + s, size) for n in range(num_nodes) for s in range(0, dpn, size)]
        size *= 2
    for k in range(1, num_nodes + 1):
        out += [(n * dpn, k * dpn) for n in range(num_nodes - k + 1)]
    return out


def strategies(size: int) -> list[ParallelStrategy]:
    return [
        ParallelStrategy(dp=size // (tp * pp), tp=tp, pp=pp)
        for tp in range(1, size + 1)
        for pp in range(1, size + 1)
        if size % (tp * pp) == 0 and tp <= 8
    ]


def random_problem(rng: np.random.Generator, num_nodes: int | None = None, dpn: int | None = None) -> PlanProblem:
    """A random problem with trainable and frozen models, data and version edges and all transfer kinds."""
    dpn = dpn or int(rng.choice([4, 8]))
    num_nodes = num_nodes or int(rng.integers(1, 4))
    meshes = valid_meshes(num_nodes, dpn)
    n_models = int(rng.integers(1, 4))
    trainable = [bool(rng.random() < 0.6) for _ in range(n_models)]
    m = int(rng.integers(max(2, n_models), 7))
    mfc_models = [i if i < n_models else int(rng.integers(n_models)) for i in range(m)]
    options = []
    for _ in range(m):
        picks = rng.choice(len(meshes), size=min(len(meshes), int(rng.integers(1, 7))), replace=False)
        opts = []
        for p in picks:
            lo, size = meshes[int(p)]
            strat = strategies(size)[int(rng.integers(len(strategies(size))))]
            opts.append(
                opt(lo, size, float(rng.uniform(0.1, 5.0)), strat, act=rng.uniform(0, 30) * GB,
                    weight=rng.uniform(0, 30) * GB, state=rng.uniform(0, 30) * GB, dpn=dpn)
            )  # fmt: skip
        options.append(opts)
    models, calls = [], [[i for i in range(m) if mfc_models[i] == mi] for mi in range(n_models)]
    for mi in range(n_models):
        home = int(rng.choice(calls[mi])) if trainable[mi] else None
        models.append(ModelEntry(f"model{mi}", trainable=trainable[mi], train_mfc=home))
    edges = [(i, k) for i in range(m) for k in range(i + 1, m) if rng.random() < 0.4]
    data_time = [np.where(rng.random((len(options[i]), len(options[k]))) < 0.5, 0.0, rng.uniform(0, 1, (len(options[i]), len(options[k])))) for i, k in edges]  # fmt: skip
    version = [(i, k) for i in range(m) for k in range(m) if mfc_models[i] == mfc_models[k] and rng.random() < 0.5]
    realloc, reload = {}, {}
    for mi, model in enumerate(models):
        for i in calls[mi]:
            if model.trainable and i != model.train_mfc:
                h = model.train_mfc
                table = rng.uniform(0.01, 1.0, (len(options[h]), len(options[i])))
                for a, oa in enumerate(options[h]):
                    for b, ob in enumerate(options[i]):
                        if (oa.mesh, oa.strategy) == (ob.mesh, ob.strategy):
                            table[a, b] = 0.0
                realloc[(h, i)] = table
            if not model.trainable and len(calls[mi]) > 1:
                reload[i] = rng.uniform(0.01, 1.0, len(options[i]))
    options, realloc = _replicate_some(rng, options, realloc)
    return PlanProblem(
        num_nodes=num_nodes,
        devices_per_node=dpn,
        device_memory_bytes=float(rng.uniform(40, 120)) * GB,
        mfc_names=[f"mfc{i}" for i in range(m)],
        mfc_models=mfc_models,
        options=options,
        models=models,
        data_edges=edges,
        data_time=data_time,
        version_edges=version,
        realloc_time=realloc,
        reload_time=reload,
        hook_time=_random_hooks(rng, options, models),
        num_iterations=int(rng.integers(1, 5)),
    )


def _replicate_some(rng, options, realloc):
    """Mark some options as dp-replicated copies (a generation's layout); a reallocation onto one is
    never free, even from an option with the same mesh and strategy."""
    options = [[dataclasses.replace(o, replicated=bool(rng.random() < 0.3)) for o in opts] for opts in options]
    for (h, i), table in realloc.items():
        for a, b in zip(*np.nonzero(table == 0)):
            if options[h][a].replicated != options[i][b].replicated:
                table[a, b] = float(rng.uniform(0.01, 0.2))
    return options, realloc


def _random_hooks(rng, options, models) -> dict[tuple[int, int], np.ndarray]:
    """EMA blends into some calls from the home of a trainable model."""
    homes = [m.train_mfc for m in models if m.trainable]
    hooks = {}
    for i in range(len(options)):
        if homes and rng.random() < 0.3:
            src = int(rng.choice(homes))
            hooks[(src, i)] = rng.uniform(0.01, 0.5, (len(options[src]), len(options[i])))
    return hooks


def random_choice(rng: np.random.Generator, problem: PlanProblem) -> list[int]:
    return [int(rng.integers(len(o))) for o in problem.options]


# ----------------------------------------------------------------------------- a PPO-shaped problem

PPO_MFCS = ["actor_gen", "reward_inf", "ref_inf", "critic_inf", "actor_train", "critic_train"]
PPO_DATA_EDGES = [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 4), (1, 5), (2, 4), (3, 4), (3, 5)]


def ppo_problem(num_nodes: int = 1, dpn: int = 8, memory_gb: float = 80.0, num_iterations: int = 3,
                keep=lambda mfc, mesh, strategy: True) -> PlanProblem:  # fmt: skip
    """PPO's six MFCs over four 14 GB models with a simple analytic cost: work / devices, slowed by
    tp and pp, plus a synchronisation cost growing with the mesh (so that splitting the cluster can
    pay); weights split by tp·pp (and by dp for training, ZeRO-3 style); ``keep`` filters options."""
    work = [40.0, 4.0, 4.0, 4.0, 24.0, 24.0]  # device-seconds of each MFC
    sync = [2.0, 0.3, 0.3, 0.3, 1.5, 1.5]  # seconds of synchronisation on a very large mesh
    weights, act = 14 * GB, [20 * GB, 4 * GB, 4 * GB, 4 * GB, 16 * GB, 16 * GB]
    options = []
    for i in range(6):
        opts = []
        for lo, size in valid_meshes(num_nodes, dpn):
            for s in strategies(size):
                if s.tp > dpn or not keep(PPO_MFCS[i], mesh(lo, size, dpn), s):
                    continue
                slow = 1 + 0.08 * (s.tp - 1) + (0.3 if i == 0 else 0.1) * (s.pp - 1)
                train = i >= 4
                w = weights / (s.tp * s.pp) / (s.dp if train else 1)
                opts.append(opt(lo, size, work[i] / size * slow + sync[i] * (1 - 1 / size), s, act=act[i] / size, weight=w,
                                state=(6 * weights / size) if train else 0.0, dpn=dpn))  # fmt: skip
        options.append(opts)
    data_time = []
    for i, k in PPO_DATA_EDGES:
        t = np.array([[0.0 if a.mesh == b.mesh else 0.05 for b in options[k]] for a in options[i]])
        data_time.append(t)
    realloc = {}
    for h, i in ((4, 0), (5, 3)):
        realloc[(h, i)] = np.array(
            [[0.0 if (a.mesh, a.strategy) == (b.mesh, b.strategy) else 0.2 for b in options[i]] for a in options[h]]
        )
    return PlanProblem(
        num_nodes=num_nodes,
        devices_per_node=dpn,
        device_memory_bytes=memory_gb * GB,
        mfc_names=list(PPO_MFCS),
        mfc_models=[0, 3, 2, 1, 0, 1],
        options=options,
        models=[
            ModelEntry("actor", True, 4),
            ModelEntry("critic", True, 5),
            ModelEntry("ref", False),
            ModelEntry("reward", False),
        ],
        data_edges=list(PPO_DATA_EDGES),
        data_time=data_time,
        version_edges=[(4, 0), (5, 3)],
        realloc_time=realloc,
        num_iterations=num_iterations,
    )
