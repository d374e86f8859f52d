"""The ``rlflow`` command: ``train``, ``plan``, ``profile`` and ``draw``.

Every subcommand is one entry of :data:`COMMANDS`: a help line, a function adding its arguments
to an ``argparse`` sub-parser and a function running it (returning the exit status).

    rlflow train recipes/grpo_arithmetic.yaml trainer.total_steps=20 models.actor.lr=1e-4
    rlflow train trainer.total_steps=2 --print-config
    rlflow plan --algo ppo --actor llama2-7b --critic llama2-7b --nodes 1 --batch 512 \\
        --prompt-len 128 --gen-len 896 --search-seconds 30 --out plan.json --timeline plan.png
    rlflow profile --out profile.json
    rlflow draw --algo grpo --out grpo.png
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UsageError(ValueError):
    """Bad user input found after argument parsing (an unknown model, algorithm or device)."""


# ----------------------------------------------------------------------------- rlflow train


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "args",
        nargs="*",
        metavar="[recipe.yaml] key=value",
        help="a recipe YAML (e.g. recipes/grpo_arithmetic.yaml; none: the defaults), then config overrides "
        "such as trainer.total_steps=20 (see docs/configuration.md)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved, validated config as YAML and exit")


def _train_source(args: list[str]) -> tuple[str | None, list[str]]:
    """``(recipe or None, overrides)``: a first argument without ``=`` is the recipe, which must be
    an existing YAML file; every other argument must read ``key=value``."""
    from pathlib import Path

    recipe = args[0] if args and "=" not in args[0] else None
    overrides = args[1:] if recipe is not None else list(args)
    if recipe is not None and (not recipe.endswith((".yaml", ".yml")) or not Path(recipe).is_file()):
        raise UsageError(
            f"recipe {recipe!r}: expected an existing YAML file such as recipes/grpo_arithmetic.yaml "
            "(or key=value overrides of the defaults)"
        )
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UsageError(f"{bad[0]!r} is not an override; expected key=value (e.g. trainer.total_steps=20)")
    return recipe, overrides


def _run_train(args: argparse.Namespace) -> int:
    from rlflow.trainer import run_recipe  # both light: the config's imports wait until Ray is begun
    from rlflow.trainer.config_fields import ConfigError

    recipe, overrides = _train_source(args.args)
    try:
        if args.print_config:
            from rlflow.trainer.config import load_config, to_yaml  # no Ray to begin: nothing trains

            print(to_yaml(load_config(recipe, overrides)), end="")
            return 0
        # The recipe goes first in argv, so that an override whose value ends in .yaml is never
        # taken for the recipe; without one, the defaults.
        run_recipe(recipe, [recipe, *overrides] if recipe is not None else overrides)
    except ConfigError as exc:
        raise UsageError(f"bad config: {exc}") from exc
    return 0


# ----------------------------------------------------------------------------- rlflow plan


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--algo", default="ppo", help="algorithm whose dataflow graph is planned (default: ppo)")
    g.add_argument("--actor", required=True, help="actor model preset, e.g. llama2-7b")
    g.add_argument("--critic", help="critic model preset (default: the actor's)")
    g.add_argument("--ref", help="reference model preset (default: the actor's)")
    g.add_argument("--reward", help="reward model preset (default: the critic's)")
    g.add_argument("--teacher", help="distillation teacher preset, algorithm distill (default: the actor's)")
    g.add_argument("--batch", type=int, default=512, help="prompts per iteration")
    g.add_argument("--prompt-len", type=int, default=128)
    g.add_argument("--gen-len", type=int, default=896)
    g.add_argument("--minibatches", type=int, default=4, help="PPO mini-batches (optimizer steps per train call)")
    g.add_argument(
        "--recompute-old-logp",
        action="store_true",
        help="recompute the rollout's log-probs with the trainer (the actor_inf call; algorithm.recompute_old_logp)",
    )
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=int, default=1)
    g.add_argument("--devices-per-node", type=int, default=8)
    g.add_argument("--device", default="a100-80g", help="device preset: a100-80g, h100-80g, h200 or cpu")
    g.add_argument("--profile", help="hardware profile JSON from `rlflow profile` (prices the cpu preset)")
    g.add_argument(
        "--pipeline-generate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="allow pipeline-parallel generation (the built-in sampler's; --no-pipeline-generate plans for an "
        "engine that cannot pipeline, such as vLLM)",
    )
    g.add_argument(
        "--max-options",
        type=int,
        help="keep only the fastest N options of each call (their transfer tables grow with N^2; "
        "a 512-GPU cluster has ~50k options per call)",
    )
    g = p.add_argument_group("search")
    g.add_argument(
        "--search-seconds",
        type=float,
        default=30.0,
        help="wall-clock budget of the search; it stops earlier once converged, and small problems are enumerated",
    )
    g.add_argument("--search-steps", type=int, help="proposals per chain (with --seed: a reproducible plan)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chains", type=int, help="search chains, one thread each (default: min(4, cores))")
    g.add_argument(
        "--no-progress", action="store_true", help="no progress bar (default: one when stderr is a terminal)"
    )
    g = p.add_argument_group("output")
    g.add_argument("--out", help="write the plan as JSON")
    g.add_argument(
        "--timeline", help="the plan's simulated timeline: a picture (.png, .svg) or a Perfetto / Chrome trace (.json)"
    )


def _algorithm_graph(args: argparse.Namespace) -> Any:
    """``--algo``'s dataflow graph, with the old-log-prob recompute call under ``--recompute-old-logp``."""
    from rlflow.dataflow import algorithm_graph, list_algorithms

    if args.algo not in list_algorithms():
        raise UsageError(f"--algo: unknown algorithm {args.algo!r}; expected one of {list_algorithms()}")
    try:
        return algorithm_graph(args.algo, recompute_old_logp=args.recompute_old_logp)
    except ValueError as exc:
        raise UsageError(f"--recompute-old-logp: {exc}") from exc


def _model_specs(args: argparse.Namespace, model_names: list[str]) -> dict:
    from rlflow.planner.model_spec import model_preset

    critic = args.critic or args.actor
    chosen = {"actor": args.actor, "ref": args.ref or args.actor, "critic": critic, "reward": args.reward or critic}
    chosen["teacher"] = args.teacher or args.actor
    specs = {}
    for name in model_names:
        if name not in chosen:
            raise UsageError(f"the graph has a model {name!r} with no preset option; known: {sorted(chosen)}")
        try:
            specs[name] = model_preset(chosen[name], value_head=name in ("critic", "reward"))
        except ValueError as exc:
            raise UsageError(f"--{name}: {exc}") from exc
    return specs


@dataclass(frozen=True)
class PlanInputs:
    """What the ``plan`` arguments describe, and the problem built from them in ``build_seconds``."""

    graph: Any
    models: dict
    cluster: Any
    workload: Any
    profile: Any  # the measured profile the calls were priced with (None: the analytic roofline)
    problem: Any
    build_seconds: float  # wall
    build_cpu_seconds: float
    rates: dict = field(default_factory=dict, compare=False)  # cluster -> its rates, built once

    def price(self, mfc: int, option, cluster) -> float:
        """Seconds of MFC ``mfc`` under ``option`` on ``cluster`` (the cost model the problem used)."""
        from rlflow.planner.build import pricing_rates
        from rlflow.planner.cost import call_cost

        mfc_def = self.graph.nodes[self.problem.mfc_names[mfc]]["mfc"]
        if cluster not in self.rates:
            self.rates[cluster] = pricing_rates(cluster, self.profile)
        rates = self.rates[cluster]
        model = self.models[mfc_def.model_name]
        return call_cost(mfc_def, model, option.strategy, option.mesh, cluster, self.workload, rates).time_s


def build_plan_problem(args: argparse.Namespace) -> PlanInputs:
    """The dataflow graph and the planning problem the ``plan`` arguments describe."""
    import time

    from rlflow.dataflow import model_calls
    from rlflow.planner.build import Workload, build_problem
    from rlflow.planner.cluster import cluster_preset
    from rlflow.planner.space import RuntimeCapabilities

    graph = _algorithm_graph(args)
    models = _model_specs(args, list(model_calls(graph)))
    try:
        profile = None
        if args.device == "cpu":  # priced from this machine: its profile, or its hardware measured now
            from rlflow.workers.profiling import profile_or_measure

            profile = profile_or_measure(args.profile)
        cluster = cluster_preset(args.device, args.nodes, args.devices_per_node, profile=profile)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from exc
    workload = Workload(args.batch, args.prompt_len, args.gen_len, n_ppo_minibatches=args.minibatches)
    caps = RuntimeCapabilities(pipeline_generate=args.pipeline_generate)
    wall, cpu = time.perf_counter(), time.process_time()
    if args.max_options is not None and args.max_options < 1:
        raise UsageError(f"--max-options={args.max_options} must be >= 1")
    problem = build_problem(
        graph, models, cluster, workload, capabilities=caps, profile=profile, max_options_per_mfc=args.max_options
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return PlanInputs(graph, models, cluster, workload, profile, problem, wall, cpu)


def _run_plan(args: argparse.Namespace) -> int:
    from rlflow.dataflow import mfcs_of
    from rlflow.planner.baselines import baseline_plans
    from rlflow.planner.plan import ExecutionPlan, format_seconds
    from rlflow.planner.search import plan_search, search
    from rlflow.planner.simulate import Simulator

    inputs = build_plan_problem(args)
    graph, problem = inputs.graph, inputs.problem
    n_options = sum(len(o) for o in problem.options)
    print(
        f"problem: {problem.num_mfcs} calls, {n_options} options, built in {inputs.build_seconds:.1f} s "
        f"({inputs.build_cpu_seconds:.1f} CPU s)"
    )
    generate = [m.name for m in mfcs_of(graph) if m.interface_type == "generate" and m.name in problem.mfc_names]
    sim = Simulator(problem)
    baselines = baseline_plans(problem, generate, sim)
    starts = [b.choice for b in baselines if b.choice is not None]
    if args.search_steps is None:  # the budget fits the problem: enumerated when small, else until converged
        found = plan_search(
            sim,
            max_seconds=args.search_seconds,
            seed=args.seed,
            initial_plans=starts,
            progress=False if args.no_progress else None,
            num_chains=args.chains,
        )
    else:
        found = search(
            sim,
            max_steps=args.search_steps,
            num_chains=args.chains,
            seed=args.seed,
            initial_plans=starts,
            progress=False if args.no_progress else None,
        )
    plan = ExecutionPlan.from_choice(problem, found.choice, found.result, name="search")
    print(plan.to_table())
    print(f"\n{found.summary()}")
    print(_comparison(plan.iteration_time_s, baselines, format_seconds))
    explanation = _explain(inputs, sim, found, baselines)
    if explanation is not None:
        print(f"\n{explanation.to_text()}")
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    if args.timeline:
        from rlflow.planner.timeline import save_timeline

        title = f"{args.algo}: {args.actor} actor on {args.nodes}x{args.devices_per_node} {args.device}"
        intervals = found.result.intervals(problem.mfc_names)
        strategies = {c.name: c.strategy for c in plan.calls}
        save_timeline(intervals, args.timeline, title, found.result.iteration_end_s, problem.num_devices, strategies)
        print(f"timeline written to {args.timeline}")
    return 0


def _explain(inputs: PlanInputs, sim, found, baselines):
    """The searched plan against the heuristic, or the fastest feasible baseline when the heuristic
    is infeasible; ``None`` when no baseline is feasible."""
    from rlflow.planner.explain import explain_plan

    feasible = [b for b in baselines if b.feasible]
    if not feasible:
        return None
    reference = next((b for b in feasible if b.name == "heuristic"), min(feasible, key=lambda b: b.iteration_time_s))
    cp = sim.compiled
    return explain_plan(
        inputs.problem,
        (found.choice, found.result),
        (reference.name, reference.choice, sim.evaluate(reference.choice)),
        inputs.price,
        inputs.cluster,
        (cp.period_from, cp.period_to),
    )


def _comparison(searched_s: float, baselines, fmt) -> str:
    rows = [("plan", "time/iteration", "relative to search"), ("search", fmt(searched_s), "1.00x")]
    for b in baselines:
        if b.feasible:
            rows.append((b.name, fmt(b.iteration_time_s), f"{b.iteration_time_s / searched_s:.2f}x"))
        else:
            rows.append((b.name, "infeasible", b.reason))
    widths = [max(len(r[k]) for r in rows) for k in range(2)]
    return "\n".join(f"{r[0].ljust(widths[0])}  {r[1].ljust(widths[1])}  {r[2]}" for r in rows)


# ----------------------------------------------------------------------------- rlflow profile / draw


def _profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="where to write the profile JSON (default: the per-host default path)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="what to profile (default: cuda when available)")


def _run_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlflow.planner.profile import default_profile_path
    from rlflow.workers.profiling import run_profile

    path = Path(args.out) if args.out else default_profile_path()
    profile = run_profile(path, args.device)
    print(f"profiled {profile.device} in {profile.elapsed_s:.1f} s -> {path}")
    for key, value in sorted(profile.hardware.to_dict().items()):
        print(f"  {key}: {value:.4g}")
    return 0


def _draw_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algo", required=True, help="algorithm whose dataflow graph is drawn")
    p.add_argument("--out", required=True, help="output picture (.png, .svg or .pdf)")
    p.add_argument("--unroll", type=int, default=1, help="iterations to unroll (shows parameter-version edges)")
    p.add_argument("--recompute-old-logp", action="store_true", help="with the old-log-prob recompute call (actor_inf)")


def _run_draw(args: argparse.Namespace) -> int:
    from rlflow.dataflow import draw, unroll_graph

    if args.unroll < 1:
        raise UsageError(f"--unroll={args.unroll} must be >= 1")
    graph = _algorithm_graph(args)
    path = draw(unroll_graph(graph, args.unroll) if args.unroll > 1 else graph, args.out)
    print(f"dataflow graph of {args.algo} written to {path}")
    return 0


COMMANDS: dict[str, Command] = {
    "train": Command(
        "train a recipe (YAML) with key=value overrides (no recipe: the defaults)", _train_arguments, _run_train
    ),
    "plan": Command("search the execution plan of an algorithm on a cluster", _plan_arguments, _run_plan),
    "profile": Command("measure this machine for the cost model", _profile_arguments, _run_profile),
    "draw": Command("draw an algorithm's dataflow graph", _draw_arguments, _run_draw),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlflow", description="RL post-training of language models with planned parallelism."
    )
    parser.add_argument("--version", action="version", version=f"rlflow {importlib.metadata.version('rlflow')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlflow`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as exc:
        parser.exit(2, f"rlflow {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
