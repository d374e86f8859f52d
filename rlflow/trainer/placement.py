"""From a config and a dataflow graph to a placement of every MFC: mesh, strategy, hook ranks.

Four modes, all priced by the same simulator so their estimates can be compared:

* ``auto``: build the planning problem with the cost model (calibrated by a measured profile
  of this machine on CPU, cached per host and shape), then every plan evaluated when they are
  few, else Metropolis–Hastings search seeded with the baselines until it converges or
  ``placement.search_seconds`` are spent;
* ``heuristic``: every call on the whole cluster, tp inside hosts, pp across hosts;
* ``colocated``: every call on all devices, FSDP over all of them (verl's layout);
* ``manual``: meshes and strategies written in the config.

Rule-based reward calls need no device; they run data-parallel over every worker.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import networkx as nx
import torch
from transformers import AutoConfig

from rlflow.dataflow import mfcs_of, rollout_calls
from rlflow.engine.parallelize import layer_matmul_params, resolve_compute_dtype
from rlflow.engine.rollout import get_rollout_engine
from rlflow.planner.baselines import BaselinePlan, baseline_plans, colocated_plan, heuristic_plan, manual_plan
from rlflow.planner.build import Workload, build_problem
from rlflow.planner.cluster import ClusterSpec, cluster_preset
from rlflow.planner.model_spec import ModelSpec, lora_adapted_params, lora_param_count, lora_tensor_count
from rlflow.planner.plan import ExecutionPlan
from rlflow.planner.problem import PlanProblem
from rlflow.planner.profile import CallTimings, MachineProfile, cached_profile_path, profile_cache_key, save_profile
from rlflow.planner.search import plan_search
from rlflow.planner.simulate import simulate
from rlflow.planner.space import RuntimeCapabilities
from rlflow.strategy import ParallelStrategy
from rlflow.trainer.config import ConfigError, LoraConfig, RLFlowConfig
from rlflow.trainer.runner import CallPlacement
from rlflow.workers.profiling import CachedProfile, cached_profile, cached_profile_of, host_identity, profile_or_measure

logger = logging.getLogger(__name__)

GPU_PRESET = "h100-80g"  # used to price a GPU cluster when no profile of it is given


@dataclass
class Placement:
    """The outcome of planning.

    Attributes:
        calls: MFC name -> where it runs (every MFC of the graph, host calls included).
        plan: the chosen plan with its estimates (``None`` for a graph without device calls).
        baselines: the baselines priced by the same simulator, for comparison.
        problem: the planning problem the plan indexes into.
        threads: torch threads of each CPU worker: 1, or every core of the host for a plan of
            one worker that runs faster so (:func:`one_worker_on_every_core`).
        rounds: MFC name -> times an iteration runs it, where not once (dynamic sampling's
            generation rounds, as priced).
    """

    calls: dict[str, CallPlacement]
    plan: ExecutionPlan | None
    baselines: list[BaselinePlan] = field(default_factory=list)
    problem: PlanProblem | None = None
    threads: int = 1
    rounds: dict[str, float] = field(default_factory=dict)

    def estimated_call_seconds(self) -> dict[str, float]:
        """MFC name -> the cost model's estimate of one call (s); the plan's iteration runs a
        call of :attr:`rounds` that many times."""
        return {} if self.plan is None else {c.name: c.time_s / self.rounds.get(c.name, 1.0) for c in self.plan.calls}

    @property
    def used_ranks(self) -> tuple[int, ...]:
        """The worker ranks (global device ids) the plan's device calls run on, sorted; every
        rank of the pool when nothing is planned. A plan may leave devices of the pool idle (one
        worker can be faster than two when per-call overheads dominate): the trainer need start
        workers only for these ranks."""
        return _used_ranks(self.plan, self.num_workers)

    @property
    def num_workers(self) -> int:
        """Workers of the pool the plan was made for (``num_nodes * devices_per_node``)."""
        return 0 if self.problem is None else self.problem.num_devices


def model_specs(
    model_paths: Mapping[str, str | None],
    value_heads: set[str],
    lora: Mapping[str, LoraConfig] | None = None,
    keep_copies: bool | None = None,
) -> dict[str, ModelSpec]:
    """Planner specs of the models that have weights, read from their HF configs; a model of ``lora``
    (``models.<role>.lora``) trains its adapters only (:attr:`ModelSpec.trainable_params`) and, with
    ``push: adapters`` unless copies are never kept (``placement.keep_copies`` false), pushes them
    alone after the first push (:attr:`ModelSpec.push_params`; null prices the copies as kept)."""
    specs = {}
    for name, path in model_paths.items():
        if path is None:
            continue
        config = AutoConfig.from_pretrained(path)
        spec = ModelSpec.from_hf_config(config, value_head=name in value_heads, name=name)
        if lora and name in lora:
            adapters = lora_param_count(config, lora[name].r, lora[name].target_modules)
            spec = replace(spec, trainable_params=adapters)
            if lora[name].push == "adapters" and keep_copies is not False:
                targets = lora[name].target_modules
                spec = replace(
                    spec,
                    push_params=adapters,
                    push_tensors=lora_tensor_count(config, targets),
                    push_base_params=lora_adapted_params(config, targets),
                )
        specs[name] = spec
    return specs


def planning_cluster(cfg: RLFlowConfig, use_gpu: bool, profile: MachineProfile | None) -> ClusterSpec:
    """The cluster the planner prices: CPU workers priced from ``profile`` (else this host's
    profile, else its hardware rates, cached unless ``placement.profile_cache`` is false), or
    GPUs of the preset type as the configured rollout engine runs on them (its dtype, its share
    of memory, and no per-layer decode dispatch for an engine that replays a CUDA graph), computing
    in the actor's ``models.actor.dtype`` (one precision for every model: the cluster holds one).
    CPU workers are priced at the profile's float32 rates whatever the dtype."""
    p = cfg.placement
    if use_gpu:
        cluster = cluster_preset(GPU_PRESET, p.num_nodes, p.devices_per_node)
        # The engine generates in its own dtype (vLLM: bf16) or in that of the copy it is given
        # (the HF sampler: the model's compute dtype); one that holds a share of the memory while it
        # generates (vLLM: weights and KV cache) is charged that share.
        engine = get_rollout_engine(cfg.rollout.engine)
        compute = resolve_compute_dtype(cfg.model_dtype("actor"), "cuda")
        cluster = cluster.with_precision(
            compute_bytes=compute.itemsize, rollout_bytes=(engine.weight_dtype or compute).itemsize
        )
        if engine.holds_memory_fraction:
            cluster = replace(cluster, rollout_memory_fraction=cfg.rollout.gpu_memory_utilization)
        if engine.capabilities.graph_decode:  # its decode step is one graph replay: no launch per layer
            # (its own per-step host work, sampler and scheduler, is not measured: not priced)
            cluster = replace(cluster, decode_layer_dispatch_s=0.0, decode_step_dispatch_s=0.0)
        return cluster
    rates = profile_or_measure(profile, refresh=not p.profile_cache)
    return cluster_preset("cpu", p.num_nodes, p.devices_per_node, profile=rates)


def planning_workload(cfg: RLFlowConfig, multi_turn: bool = False, graph: nx.DiGraph | None = None) -> Workload:
    """Batch and lengths of one iteration as the cost model sees them.

    Under ``algorithm.dynamic_sampling`` the calls of a generation round of ``graph``
    (:func:`rlflow.dataflow.rollout_calls`) run ``algorithm.dynamic_sampling_rounds`` times an iteration.

    ``multi_turn`` rows are ``rollout.multi_turn.max_prompt_tokens`` + ``max_total_tokens`` long,
    priced as ``max_turns`` turns of ``rollout.max_new_tokens`` sampled tokens (fewer when the budget
    holds fewer) with the rest of the budget as observations between them, each turn prefilling
    its context again and, but the last, waiting ``rollout.multi_turn.tool_seconds`` per episode step.
    """
    mt = cfg.rollout.multi_turn
    turn = cfg.rollout.max_new_tokens or cfg.data.max_response_len
    multi = {}
    if multi_turn:
        turn = min(turn, mt.max_total_tokens)
        turns = min(mt.max_turns, mt.max_total_tokens // turn)
        observation = (mt.max_total_tokens - turns * turn) // (turns - 1) if turns > 1 else 0
        multi = {"turns": turns, "observation_len": observation, "tool_s": mt.tool_seconds,
                 "tool_threads": mt.num_threads}  # fmt: skip
    algo = cfg.algorithm
    if algo.dynamic_sampling and graph is not None:
        multi |= {"rollout_rounds": algo.dynamic_sampling_rounds, "rollout_calls": frozenset(rollout_calls(graph))}
    return Workload(
        batch_size=cfg.data.batch_size,
        prompt_len=mt.max_prompt_tokens if multi_turn else cfg.data.max_prompt_len,
        gen_len=mt.max_total_tokens if multi_turn else turn,
        **multi,
        n_samples_per_prompt=cfg.algorithm.n_samples if _samples(cfg) else 1,
        n_ppo_minibatches=cfg.algorithm.n_minibatches,
        ppo_epochs=cfg.algorithm.ppo_epochs,
        gradient_checkpointing=any(m.gradient_checkpointing for m in cfg.models.values()),
        # The engines run one micro-batch per (mini-)batch unless a model sets a token budget.
        max_tokens_per_mb=min(
            (m.micro_batch_tokens for m in cfg.models.values() if m.micro_batch_tokens), default=None
        ),
        shared_prompts=_samples(cfg) and all(m.shared_prefix for m in cfg.models.values()),
    )


def runtime_capabilities(
    cfg: RLFlowConfig, multi_turn: bool = False, specs: Mapping[str, ModelSpec] | None = None
) -> RuntimeCapabilities:
    """What the configured rollout engine declares it runs (its ``capabilities``): its parallel
    axes, and a generation on every worker of the pool when it ``spans_world`` (vLLM's external
    launcher builds groups over the whole world); a LoRA model, and a mixture-of-experts model of
    ``specs`` whose ``router_aux_loss_coef`` is not 0 (the router loss pools every layer of a forward),
    train with tp = pp = 1; ``multi_turn`` rollouts generate on one process per dp rank (no tp or pp:
    an episode's tools would run once per rank)."""
    rollout = get_rollout_engine(cfg.rollout.engine).capabilities
    world = cfg.placement.num_nodes * cfg.placement.devices_per_node
    lora = {role for role, m in cfg.models.items() if m.lora is not None}
    routed = {
        role
        for role, spec in (specs or {}).items()
        if spec.num_experts and role in cfg.models and cfg.models[role].router_aux_loss_coef != 0
    }
    return RuntimeCapabilities(
        pipeline_generate=rollout.pp and not multi_turn,
        tensor_parallel_generate=rollout.tp and not multi_turn,
        generate_world_size=world if rollout.spans_world else None,
        data_parallel_train_models=frozenset(lora | routed),
    )


def _samples(cfg: RLFlowConfig) -> bool:
    return cfg.algorithm.record.samples_responses


def plan_placement(
    cfg: RLFlowConfig,
    graph: nx.DiGraph,
    specs: Mapping[str, ModelSpec],
    *,
    use_gpu: bool,
    profile: MachineProfile | None = None,
    progress: bool | None = None,
    multi_turn: bool = False,
    calibrates: bool = False,
) -> Placement:
    """Plans every MFC of ``graph`` according to ``cfg.placement.mode``; generate calls of
    ``multi_turn`` rollouts with tp = pp = 1 (:func:`runtime_capabilities`). ``calibrates``: the
    run will calibrate the plan by its own calls (a shape new to the host), so the one-worker plan,
    whose every-core speedups at the run's shapes only a run of it measures, is taken when priced
    within :data:`ONE_WORKER_EXPLORE` of the searched plan (:func:`one_worker_on_every_core`).

    Raises:
        ValueError: a manual plan that is not among the valid options (names the MFC), or a
            plan that does not fit device memory in a mode that cannot choose another.
    """
    p = cfg.placement
    device_mfcs = [m for m in mfcs_of(graph) if not m.runs_on_host]
    if p.mode == "manual":
        check_manual_strategies(cfg, device_mfcs, specs)
    problem = plan = None
    baselines: list[BaselinePlan] = []
    threads = 1
    workload = planning_workload(cfg, multi_turn, graph)
    if use_gpu and importlib.util.find_spec("flash_attn") is not None:  # the engines pack rows: no shared prompts
        workload = replace(workload, shared_prompts=False)
    if device_mfcs:
        cluster = planning_cluster(cfg, use_gpu, profile)
        problem = build_problem(
            graph,
            dict(specs),
            cluster,
            workload,
            capabilities=runtime_capabilities(cfg, multi_turn, specs),
            profile=profile,
            policy_lag=getattr(cfg.algorithm, "policy_lag", 0),
        )
        generate = [m.name for m in device_mfcs if m.interface_type == "generate"]
        baselines = baseline_plans(problem, generate)
        plan = _choose(p.mode, problem, baselines, generate, cfg, progress)
        if p.mode == "auto" and not use_gpu and profile is not None and profile.calls is not None:
            kinds = {m.name: m.interface_type for m in device_mfcs}
            explore, why = one_worker_explore(profile, calibrates)
            plan, threads = one_worker_on_every_core(
                problem, plan, profile.calls, kinds, p.devices_per_node, profile.host_speedups,
                explore=explore, why=why,
            )  # fmt: skip
    calls = _call_placements(graph, plan, cfg)
    rounds = {m.name: workload.rollout_rounds for m in device_mfcs if m.name in workload.rollout_calls}
    return Placement(calls, plan, baselines, problem, threads, rounds)


# The profiled whole call that prices each interface type.
PROFILED_CALL = {"generate": "generate", "inference": "forward", "train_step": "train"}
# A run that calibrates a new shape takes the one-worker plan when priced within this factor of the
# searched plan: its every-core speedups come from the machine profile's small reference model, whose
# calls gain less from a second thread than a larger model's, until the run measures its own — which
# its calibration does on a one-worker plan only (a multi-worker plan's never measures the one-worker
# alternative; a one-worker plan's calibration re-plans onto the searched one when that is faster).
ONE_WORKER_EXPLORE = 2.0
# A one-worker plan a run has measured at these shapes (its every-core speedups and its corrections on
# one device) keeps its place unless a plan priced from uncalibrated estimates is this many times faster:
# the estimates of a regime no run of the shape measured are off by more (docs/benchmarks.md, the
# compute task capped at AVX2 in "All three tasks on an AVX-512 CPU whose bf16 matmuls are slower ...").
MEASURED_ONE_WORKER_MARGIN = 1.25


def one_worker_explore(profile: MachineProfile, calibrates: bool) -> tuple[float, str]:
    """How many times the searched plan's estimate the one-worker plan may be priced at and still be
    taken, and why (:func:`one_worker_on_every_core`'s ``explore`` and ``why``): :data:`ONE_WORKER_EXPLORE`
    for a run that calibrates a shape whose every-core speedups no run measured;
    :data:`MEASURED_ONE_WORKER_MARGIN` where a run measured them and the one-device regime
    (``alone_corrections``) but no run calibrated the busy one (``corrections``) the searched plan is
    priced in; else 1.

    >>> from types import SimpleNamespace as Profile
    >>> one_worker_explore(Profile(host_speedups=None, alone_corrections=None, corrections=None), calibrates=True)[0]
    2.0
    >>> measured = Profile(host_speedups={"generate": 1.4}, alone_corrections={"generate": 1.3}, corrections=None)
    >>> one_worker_explore(measured, calibrates=False)[0]
    1.25
    >>> one_worker_explore(Profile(**{**vars(measured), "corrections": {"generate": 1.1}}), calibrates=False)[0]
    1.0
    """
    if not profile.host_speedups:
        if calibrates:
            return ONE_WORKER_EXPLORE, "for the run to measure its speedups on every core (a shape new to this host)"
        return 1.0, ""
    if profile.alone_corrections and not profile.corrections:
        return (
            MEASURED_ONE_WORKER_MARGIN,
            "a plan a run of this shape measured, against one priced in a regime no run calibrated",
        )
    return 1.0, ""


def one_worker_on_every_core(
    problem: PlanProblem,
    plan: ExecutionPlan,
    timings: CallTimings,
    kinds: Mapping[str, str],
    cores: int,
    measured: Mapping[str, float] | None = None,
    explore: float = 1.0,
    why: str = "",
) -> tuple[ExecutionPlan, int]:
    """``plan``, or the plan of one worker with a thread per core of its host where that is
    estimated faster; and the threads its CPU workers take.

    The one-worker plan (every call on device 0, dp = tp = pp = 1) is priced as the simulator
    prices it with one thread, each call's time divided by its kind's measured speedup on every
    core (:meth:`CallTimings.host_speedup`: the whole batch in one process, one thread against
    ``cores``), or the speedup a run ``measured`` at its own shapes (``MachineProfile.host_speedups``,
    by profiled call); its transfers are unchanged. Without those timings (a one-worker host, an
    older profile) ``plan`` stays, with one thread. ``explore`` > 1: the one-worker plan is taken
    when estimated at most that many times ``plan``'s time, ``why`` said in the log
    (:func:`one_worker_explore`).
    """
    measured = measured or {}
    speedups = {kind: measured.get(call) or timings.host_speedup(call) for kind, call in PROFILED_CALL.items()}
    if cores < 2 or any(v is None for v in speedups.values()):
        return plan, 1
    choice = []
    for options in problem.options:
        one = [j for j, o in enumerate(options) if tuple(o.mesh.device_ids) == (0,) and o.strategy.world_size == 1]
        if not one:
            return plan, 1
        choice.append(one[0])
    base = ExecutionPlan.from_choice(problem, tuple(choice), simulate(problem, tuple(choice)), name="one worker")
    if not base.fits:
        return plan, 1
    calls = tuple(replace(c, time_s=c.time_s / speedups[kinds[c.name]]) for c in base.calls)
    saved = sum(c.time_s for c in base.calls) - sum(c.time_s for c in calls)
    estimate = base.iteration_time_s - saved
    if estimate >= plan.iteration_time_s * explore:
        return plan, 1
    if estimate >= plan.iteration_time_s:
        logger.info(
            "one worker on all %d cores: est. %.3f s/iteration, within %.2fx of the %s plan's %.3f s; taking it: %s",
            cores, estimate, explore, plan.name, plan.iteration_time_s, why,
        )  # fmt: skip
    else:
        logger.info(
            "one worker on all %d cores: est. %.3f s/iteration, faster than the %s plan's %.3f s; taking it",
            cores, estimate, plan.name, plan.iteration_time_s,
        )  # fmt: skip
    return replace(base, calls=calls, iteration_time_s=estimate, name=f"one worker, {cores} threads"), cores


def check_manual_strategies(cfg: RLFlowConfig, mfcs, specs: Mapping[str, ModelSpec]) -> None:
    """Refuses a manual strategy its call's model cannot run: a tp its heads or kv heads do not
    divide, more pipeline stages than layers, or tp/pp above 1 for a model without the family
    record that splits it (:attr:`ModelSpec.tp_blocker`, ``pp_blocker``).

    Raises:
        ConfigError: names ``placement.manual.<call>.strategy.tp`` (or ``.pp``) and what would work.
    """
    for mfc in mfcs:
        entry, model = cfg.placement.manual.get(mfc.name), specs.get(mfc.model_name)
        if entry is None or model is None:
            continue  # a missing entry is refused by the plan, which lists the calls
        key, s = f"placement.manual.{mfc.name}.strategy", entry.strategy
        if s.tp > 1 and model.tp_blocker:
            raise ConfigError(f"{key}.tp", f"{s.tp} for model {mfc.model_name!r}: {model.tp_blocker}")
        if s.pp > 1 and model.pp_blocker:
            raise ConfigError(f"{key}.pp", f"{s.pp} for model {mfc.model_name!r}: {model.pp_blocker}")
        if model.num_heads % s.tp or model.num_kv_heads % s.tp:
            fits = [t for t in range(1, model.num_kv_heads + 1) if model.num_kv_heads % t == 0]
            raise ConfigError(
                f"{key}.tp",
                f"{s.tp} does not divide model {mfc.model_name!r}'s num_attention_heads={model.num_heads} and "
                f"num_key_value_heads={model.num_kv_heads}; tp may be {fits}",
            )
        if s.pp > model.num_layers:
            raise ConfigError(
                f"{key}.pp",
                f"{s.pp} stages for model {mfc.model_name!r}'s {model.num_layers} layers; at most one per layer",
            )


def _choose(
    mode: str,
    problem: PlanProblem,
    baselines: list[BaselinePlan],
    generate: list[str],
    cfg: RLFlowConfig,
    progress: bool | None,
) -> ExecutionPlan:
    if mode == "auto":
        shared = get_rollout_engine(cfg.rollout.engine).capabilities.shared_layout
        ties = tied_generate_options(problem, generate) if shared else [{}]
        seconds = max(cfg.placement.search_seconds, 0.1) / len(ties)
        best = None
        for keep in ties:  # one search per shared generation layout, the best kept
            sub = problem.restricted(keep)
            seeds = [_restricted_choice(b.choice, keep) for b in baselines if b.feasible]
            result = plan_search(
                sub,
                max_seconds=seconds,
                seed=cfg.seed,
                initial_plans=[c for c in seeds if c is not None],
                progress=progress,
            )
            logger.info(result.summary())  # how much of the budget the problem needed
            if best is None or result.cost < best[1].cost:
                best = (sub, result)
        sub, result = best
        choice = fewest_devices(sub, result)
        return ExecutionPlan.from_choice(sub, choice, simulate(sub, choice), name="search")
    if mode == "heuristic":
        chosen = heuristic_plan(problem)
    elif mode == "colocated":
        chosen = colocated_plan(problem)
    else:
        chosen = manual_plan(problem, _manual_config(cfg, problem))
    if chosen.choice is None:
        raise ValueError(f"placement.mode={mode!r}: {chosen.reason}")
    return ExecutionPlan.from_choice(problem, chosen.choice, chosen.result, name=mode)


def fewest_devices(problem: PlanProblem, result) -> tuple[int, ...]:
    """Among the search's cheapest plans of equal cost (to 1e-9), the one on the fewest devices,
    then the lowest: a worker no call uses need not be started (:attr:`Placement.used_ranks`)."""
    tied = [r.choice for r in result.top if r.cost <= result.cost * (1 + 1e-9)] or [result.choice]

    def devices(choice: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        used = sorted({d for i, j in enumerate(choice) for d in problem.options[i][j].mesh.device_ids})
        return len(used), tuple(used)

    return min(tied, key=devices)


def tied_generate_options(problem: PlanProblem, generate: list[str]) -> list[dict[int, list[int]]]:
    """The generate calls of one model on one layout, as a rollout engine with a ``shared_layout``
    needs (vLLM: one instance per process): one restriction per layout those calls have in common, each cutting
    every such call to that layout; ``[{}]`` (nothing cut) when no model has two generate calls.

    Raises:
        ValueError: two generate calls of one model share no layout.
    """
    groups: dict[int, list[int]] = {}
    for i, name in enumerate(problem.mfc_names):
        if name in generate:
            groups.setdefault(problem.mfc_models[i], []).append(i)
    restrictions: list[dict[int, list[int]]] = [{}]
    for calls in (c for c in groups.values() if len(c) > 1):
        layouts = [{(o.mesh, o.strategy): j for j, o in enumerate(problem.options[i])} for i in calls]
        common = [key for key in layouts[0] if all(key in lay for lay in layouts[1:])]
        if not common:
            names = [problem.mfc_names[i] for i in calls]
            raise ValueError(
                f"the rollout engine shares one layout among a model's generate calls, but {names} share no "
                "layout the planner may choose"
            )
        restrictions = [
            {**r, **{i: [lay[key]] for i, lay in zip(calls, layouts)}} for r in restrictions for key in common
        ]
    return restrictions


def _restricted_choice(choice: tuple[int, ...] | None, keep: Mapping[int, list[int]]) -> tuple[int, ...] | None:
    """``choice`` in the option indices of ``problem.restricted(keep)``; None when it is cut."""
    if choice is None:
        return None
    out = []
    for i, j in enumerate(choice):
        if i in keep:
            if j not in keep[i]:
                return None
            j = keep[i].index(j)
        out.append(j)
    return tuple(out)


def _manual_config(cfg: RLFlowConfig, problem: PlanProblem) -> dict:
    manual = cfg.placement.manual
    missing = [n for n in problem.mfc_names if n not in manual]
    if missing:
        raise ValueError(f"placement.manual has no entry for MFC(s) {missing}; the device MFCs are {problem.mfc_names}")
    return {
        name: {
            "mesh": manual[name].mesh.to_device_mesh(problem.devices_per_node),
            "strategy": manual[name].strategy.to_strategy(),
        }
        for name in problem.mfc_names
    }


def _used_ranks(plan: ExecutionPlan | None, num_workers: int) -> tuple[int, ...]:
    if plan is None or not plan.calls:
        return tuple(range(num_workers))
    return tuple(sorted({d for c in plan.calls for d in c.mesh.device_ids}))


def _call_placements(graph: nx.DiGraph, plan: ExecutionPlan | None, cfg: RLFlowConfig) -> dict[str, CallPlacement]:
    """Turns the plan into run-time placements. A host call (a rule reward) runs data-parallel
    where the rows it reads are made — on the mesh of its first planned producer (the rollout) —
    else on the workers the plan uses (every worker when nothing is planned): spread over every
    worker it would sit in the queue of a train step on a disjoint mesh, waiting for the next
    rollout, and hold that train step up."""
    ranks = _used_ranks(plan, cfg.placement.num_nodes * cfg.placement.devices_per_node)
    planned = {} if plan is None else {c.name: c for c in plan.calls}
    mfcs = mfcs_of(graph)
    layout = {}
    for mfc in mfcs:
        if mfc.name in planned:
            c = planned[mfc.name]
            layout[mfc.name] = (tuple(c.mesh.device_ids), c.strategy)
            continue
        producers = [p for p in graph.predecessors(mfc.name) if p in planned]
        home = layout[producers[0]][0] if producers else ranks
        layout[mfc.name] = (home, ParallelStrategy(dp=len(home)))
    # Hook ranks follow from every call's layout; the trainer fills them in from the worker setup.
    return {mfc.name: CallPlacement(mfc, *layout[mfc.name]) for mfc in mfcs}


def _cpu_precision(cfg: RLFlowConfig, role: str, spec: ModelSpec) -> str:
    """``"bf16"`` or ``"fp32"``: what CPU workers compute ``role``'s model of ``spec`` in (``models.<role>.dtype``)."""
    layer = layer_matmul_params({
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size, "head_dim": spec.head_dim,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
    })  # fmt: skip
    dtype = resolve_compute_dtype(cfg.models[role].dtype, "cpu", layer, cfg.pass_tokens(role))
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def profile_shapes(cfg: RLFlowConfig, spec: ModelSpec | None = None) -> dict:
    """``run_profile`` arguments that measure what the run will price: the actor's layer shape,
    and the shapes its calls run on one worker when every worker is data-parallel — a
    forward/backward over the rollout rows, a prefill of the prompts, a decode step of the rows —
    on top of a few default sizes (the rates are interpolated between them). With the actor's
    ``spec``, also whole calls of it at those shapes (a rollout, a forward and a training step),
    timed with every worker of a host running them at once, and — on a host of several workers —
    the whole batch and one worker's share in one process while the others idle, in the precision
    the workers will compute in; they calibrate the estimates of every call type on many workers
    and on one."""
    role = "actor" if "actor" in cfg.models else next(iter(cfg.models))
    m = cfg.models[role]
    layer = {k: getattr(m, k) for k in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads")}
    if spec is not None:
        layer = {k: getattr(spec, k) for k in layer}
    workers = cfg.placement.num_nodes * cfg.placement.devices_per_node
    prompts = max(1, cfg.data.batch_size // workers)
    samples = cfg.algorithm.n_samples if _samples(cfg) else 1  # responses a rollout draws per prompt
    rows = prompts * (2 if cfg.algorithm.record.dataset == "pairs" else samples)
    p, r = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens or cfg.data.max_response_len
    passes = ((1, 64), (4, 128), (4, 256), (prompts, p), (rows, p + r))
    decodes = ((1, 128), (8, 128), (32, 128), (rows, p + r // 2))
    shapes: dict = {"layer": layer, "passes": passes, "decodes": decodes}
    if spec is not None:
        fields = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size",
                  "head_dim", "tie_embeddings", "qkv_bias", "mlp_bias")  # fmt: skip
        model = {k: getattr(spec, k) for k in fields}
        shapes |= _call_shapes(
            model,
            _cpu_precision(cfg, role, spec),
            cfg.placement.devices_per_node,
            cfg.data.batch_size,
            prompts,
            samples,
            rows,
            p,
            r,
        )
    return shapes


def _call_shapes(
    model: dict,
    precision: str,
    cores: int,
    total: int,
    prompts: int,
    samples: int,
    rows: int,
    prompt_len: int,
    gen_len: int,
) -> dict:
    """The ``calls`` and ``call_processes`` of :func:`profile_shapes`: whole calls of ``model`` in
    ``precision`` on a host of ``cores`` worker processes, ``total`` prompts a step, ``prompts``
    a worker drawing ``samples`` responses each, ``rows`` a worker's training rows."""
    # A second batch size (half, or twice a single prompt) splits each call's time into the
    # part that grows with its rows and the part that does not (ProfiledRates._calibrate).
    alt = prompts // 2 if prompts > 1 else 2
    calls = {
        "model": model,
        "precision": precision,
        "generate": {"prompts": prompts, "prompt_len": prompt_len, "n": samples, "gen_len": gen_len},
        "train": {"rows": rows, "seq": prompt_len + gen_len},
        "generate_alt": {"prompts": alt, "prompt_len": prompt_len, "n": samples, "gen_len": gen_len},
        "train_alt": {"rows": rows * alt // prompts, "seq": prompt_len + gen_len},
    }
    if cores > 1:
        # The same calls in one process while the others idle, at the whole batch and at one
        # worker's share: the price of a call a plan gives one worker of the host.
        calls |= {
            "generate_alone": {"prompts": total, "prompt_len": prompt_len, "n": samples, "gen_len": gen_len},
            "train_alone": {"rows": rows * total // prompts, "seq": prompt_len + gen_len},
            "generate_alone_alt": {"prompts": prompts, "prompt_len": prompt_len, "n": samples, "gen_len": gen_len},
            "train_alone_alt": {"rows": rows, "seq": prompt_len + gen_len},
            # ... and the whole batch in one process on every core: one worker may take them all
            "host_threads": cores,
        }
    return {"calls": calls, "call_processes": cores}  # every worker of a host busy


# The machine profile a run calibrated by its own calls starts from (placement.calibrate: run):
# the default layer sizes, and whole calls of this reference model at these shapes — small enough
# to time in seconds, measured once per host and its worker count, whatever model a run trains.
REFERENCE_MODEL = {
    "num_layers": 4, "hidden_size": 256, "intermediate_size": 688, "num_heads": 8, "num_kv_heads": 8,
    "vocab_size": 256, "head_dim": 32, "tie_embeddings": True, "qkv_bias": False, "mlp_bias": False,
}  # fmt: skip
_REFERENCE_STEP = {"prompts": 2, "samples": 4, "prompt_len": 16, "gen_len": 16}
# Rounds of the machine profile's layer timings (run_profile's median per size): two, not a shape
# profile's three. The profile is measured before a new host's first step, and the run's own calls
# calibrate what it prices.
MACHINE_PROFILE_ROUNDS = 2


def machine_profile_shapes(cfg: RLFlowConfig) -> dict:
    """``run_profile`` arguments of this host's machine profile for ``cfg``'s placement: the default
    layer sizes (:data:`MACHINE_PROFILE_ROUNDS` rounds of their timings) and whole calls of
    :data:`REFERENCE_MODEL` (two prompts of four samples a worker, 16 prompt and 16 new tokens), on
    ``placement.devices_per_node`` worker processes; they depend on no model or batch of the run, so
    one measurement serves every run on the host."""
    cores, step = cfg.placement.devices_per_node, _REFERENCE_STEP
    prompts, rows = step["prompts"], step["prompts"] * step["samples"]
    calls = _call_shapes(
        REFERENCE_MODEL, "fp32", cores, prompts * cores, prompts, step["samples"], rows, step["prompt_len"],
        step["gen_len"],
    )  # fmt: skip
    return {"layer": None, "passes": None, "decodes": None, "rounds": MACHINE_PROFILE_ROUNDS, **calls}


def load_profile_for(
    cfg: RLFlowConfig, use_gpu: bool, run_dir: Path, spec: ModelSpec | None = None, progress: bool | None = None
) -> CachedProfile | None:
    """A profile of this machine at the run's shapes when ``placement.profile`` asks for one (CPU
    only: GPU clusters are priced from the presets), with whole calls of ``spec`` (the actor) when
    given: the cached one of this host and shapes unless ``placement.profile_cache`` is false,
    else measured now and cached. Either way it is copied to ``run_dir/profile.json``, the
    profile the run planned with."""
    if use_gpu or not cfg.placement.profile:
        return None
    p, shapes = cfg.placement, profile_shapes(cfg, spec)
    found = None
    if p.calibrate == "run" and spec is not None:
        found = cached_profile_of(shapes) if p.profile_cache else None
        if found is None:  # a shape new to this host: start from its machine profile, calibrate by the run
            machine = cached_profile(machine_profile_shapes(cfg), refresh=not p.profile_cache, progress=progress)
            shape_path = cached_profile_path(profile_cache_key(host_identity("cpu"), shapes))
            found = replace(machine, calibrate_to=shape_path)
    if found is None:
        found = cached_profile(shapes, refresh=not p.profile_cache, progress=progress)
    save_profile(found.profile, run_dir / "profile.json")
    what = "this host's machine profile" if found.calibrate_to is not None else "at this run's shapes"
    if found.cached:
        logger.info(f"profile: reusing {found.path} ({what}; placement.profile_cache=false measures it again)")
    else:
        logger.info(f"profile: measured in {found.profile.elapsed_s:.1f} s, cached at {found.path} ({what})")
    if found.calibrate_to is not None:
        logger.info(
            f"profile: the run's own first calls calibrate it (placement.calibrate=run), cached at {found.calibrate_to}"
        )
    return found
