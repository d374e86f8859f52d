"""The driver: ``Trainer(cfg).fit()`` runs the planned dataflow graph and reports what it learned.

Building and launching are apart: the constructor checks and prepares (config, data, reward
functions, the model and tokenizer in the run directory; :mod:`rlflow.trainer.inputs`) while a
local Ray starts on a thread when the run asks for Ray workers (:mod:`rlflow.trainer.local_ray`:
this module imports its heavy dependencies on first use, so that Ray's start and those imports
overlap), and :meth:`Trainer.launch` — called by ``fit()`` — takes that Ray over, profiles, plans
and spawns the workers; a plan of one CPU worker runs it in this process instead, without Ray
(``placement.worker_host``, :mod:`rlflow.controller.driver_host`).

``fit()`` reads as a list of named stages — resume, evaluate, warm up, copy the ``init: copy``
models from their sources, train (steps of the graph, overlapping iterations where the graph
allows), evaluate, save, report — and every stage is a method of its own. Variants are
configuration, never copies of this loop. Around the stages, ``fit()`` restarts the workers from
the last checkpoint after a recoverable failure (``trainer.max_restarts``), and the training
stage turns SIGINT/SIGTERM into a checkpoint and an exit (``checkpoint.save_on_signal``); a
checkpoint loads under whatever layouts this run planned (:mod:`rlflow.trainer.checkpoint_layouts`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlflow.lazy import LazyModule
from rlflow.trainer import local_ray
from rlflow.workers.logs import configure_logging

if TYPE_CHECKING:
    from rlflow.dataflow.algorithms import Algorithm
    from rlflow.planner.timeline import Interval
    from rlflow.protocol import DataProto
    from rlflow.trainer.config import RLFlowConfig
    from rlflow.trainer.placement import Placement
    from rlflow.trainer.runner import DataflowRunner, Submitted
    from rlflow.workers.records import CallRecord
    from rlflow.workers.reward_funcs import RewardFunc

# Loaded on first use: ``Trainer(...)`` begins a local Ray (:mod:`rlflow.trainer.local_ray`)
# before the driver imports tensordict, torch's distributed stack and the engines through these.
np = LazyModule("numpy")
ray = LazyModule("ray")
transformers = LazyModule("transformers")
controller = LazyModule("rlflow.controller")
tokenizer_io = LazyModule("rlflow.data.tokenizer")
timeline = LazyModule("rlflow.planner.timeline")
build = LazyModule("rlflow.trainer.build")
calibration = LazyModule("rlflow.trainer.calibration")
dataflow = LazyModule("rlflow.dataflow")
rollout_log = LazyModule("rlflow.trainer.rollout_log")
checkpoint_layouts = LazyModule("rlflow.trainer.checkpoint_layouts")
inputs = LazyModule("rlflow.trainer.inputs")
trainer_callbacks = LazyModule("rlflow.trainer.callbacks")
trainer_checkpoint = LazyModule("rlflow.trainer.checkpoint")
trainer_config = LazyModule("rlflow.trainer.config")
trainer_data = LazyModule("rlflow.trainer.data")
dynamic_sampling = LazyModule("rlflow.trainer.dynamic_sampling")
partial_rollouts = LazyModule("rlflow.trainer.partial_rollouts")
trainer_metrics = LazyModule("rlflow.trainer.metrics")
trainer_placement = LazyModule("rlflow.trainer.placement")
trainer_runner = LazyModule("rlflow.trainer.runner")
run_dirs = LazyModule("rlflow.trainer.run_dir")
reward_functions = LazyModule("rlflow.workers.reward_funcs")
worker_records = LazyModule("rlflow.workers.records")

log = logging.getLogger(__name__)


@dataclass
class FitResult:
    """What a run achieved.

    Attributes:
        steps: training steps completed (including earlier runs when resumed).
        eval_history: ``(step, held-out score)`` at every evaluation, in order.
        score_before: held-out score before RL (after the warm-up when there is one).
        score_after: held-out score at the end.
        warmup_steps: SFT warm-up steps taken (fewer than ``warmup.steps`` when
            ``warmup.target_score`` was reached).
        warmup_history: ``(warm-up step, held-out score)`` at every warm-up evaluation.
        mfc_seconds: MFC name -> measured seconds of each call.
        estimated_seconds: MFC name -> the planner's estimate of one call.
        run_dir: where metrics, checkpoints and pictures went.
    """

    steps: int
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    score_before: float | None = None
    score_after: float | None = None
    warmup_steps: int = 0
    warmup_history: list[tuple[int, float]] = field(default_factory=list)
    mfc_seconds: dict[str, list[float]] = field(default_factory=dict)
    estimated_seconds: dict[str, float] = field(default_factory=dict)
    run_dir: str = ""


class Trainer:
    """Builds a run: validates the config, the data and the rewards; :meth:`launch` starts the workers; :meth:`fit` trains.

    For YAML users ``Trainer(cfg)``; for Python users, in TRL's terms::

        trainer = Trainer(
            {"algorithm": {"name": "grpo"}}, model="path/or/PreTrainedModel", tokenizer=tok,
            reward_funcs=[my_reward], train_dataset=[{"prompt": "...", "label": ...}], callbacks=[on_step],
        )
        with trainer:
            result = trainer.fit()

    Construction checks and prepares (config, datasets, reward signatures, the model and
    tokenizer saved into the run directory) while a local Ray starts on a thread (when the
    settings ask for Ray workers, this process has none and no cluster is named:
    :mod:`rlflow.trainer.local_ray`; shut down again if the construction fails); the profile,
    the plan and the workers start on :meth:`launch` (which :meth:`fit` calls), the one worker
    of a one-worker CPU plan in this process unless ``placement.worker_host: ray``. ``with Trainer(...) as t:`` (or :meth:`close`) releases the
    workers, their placement groups, and a Ray instance the trainer started itself.

    Args:
        config: an ``RLFlowConfig``, a YAML path, a dict of settings, or None for the defaults.
        overrides: ``key=value`` strings applied after a YAML path or a dict.
        model: the actor: a local HF directory or a ``PreTrainedModel`` (saved into the run).
        tokenizer: a local directory or a tokenizer object (saved into the run); default: the
            model directory's tokenizer, else ``data.tokenizer``.
        reward_funcs: a function or functions ``fn(prompts, completions, **columns) -> list[float | None]``
            (:mod:`rlflow.workers.reward_funcs`), summed; each mean logged as ``<reward call>/rewards/<name>``.
            Or, as in TRL, a reward model: a local directory, a Hub id or a model object
            (:func:`rlflow.trainer.inputs.with_reward_model`), which becomes ``models.reward``.
        reward_weights: one weight per reward function (default 1 each).
        tools: typed, documented functions the policy may call (TRL's ``GRPOTrainer(tools=...)``) or
            their import paths: each rollout sample becomes a multi-turn episode of tool use
            (``rollout.multi_turn`` sets its limits; :mod:`rlflow.workers.environments`).
        environment: an environment factory (a class with ``reset(row)`` and ``step(text)``, or a
            callable making one) or its import path: each sample becomes an episode of it; its step
            rewards add to the reward functions' score.
        train_dataset: a list of dicts, a ``datasets.Dataset`` or a JSONL path; every column is
            passed to the reward functions. Replaces the synthetic task.
        eval_dataset: held-out prompts in the same forms; without one (and without a task) the
            run has no held-out score.
        callbacks: functions ``fn(step, metrics)`` or objects with ``on_step_end(step, metrics)``
            (returning True stops training), and ``transformers.TrainerCallback`` objects
            (:mod:`rlflow.trainer.callbacks`).
        algorithm: an algorithm name or an ``Algorithm`` record (sets ``algorithm.name``).
        progress_bars: show progress bars (plan search, profile, steps); None: as ``logging.progress`` says.
    """

    def __init__(
        self,
        config: RLFlowConfig | str | os.PathLike | Mapping[str, Any] | None = None,
        *,
        overrides: Sequence[str] = (),
        model: Any = None,
        tokenizer: Any = None,
        reward_funcs: RewardFunc | str | Sequence[RewardFunc | str] | None = None,
        reward_weights: Sequence[float] | None = None,
        tools: Sequence[Callable[..., Any] | str] | None = None,
        environment: Callable[[], Any] | str | None = None,
        train_dataset: inputs.DatasetLike | None = None,
        eval_dataset: inputs.DatasetLike | None = None,
        callbacks: Sequence[Any] = (),
        algorithm: str | Algorithm | None = None,
        progress_bars: bool | None = None,
    ) -> None:
        self._created = time.perf_counter()
        # A local Ray starts on a thread while the rest is imported and prepared; launch() takes it over.
        self._ray_start = local_ray.begin_local_ray(config, overrides)
        try:
            funcs, reward_model = inputs.split_reward_funcs(reward_funcs, reward_weights)
            self.cfg = self._build_config(
                config, overrides, algorithm, model, tokenizer, train_dataset, eval_dataset, reward_model
            )
            configure_logging(self.cfg.logging.level)
            show = trainer_metrics.show_progress(self.cfg.logging.progress)
            self.progress_bars: bool | None = show if progress_bars is None else progress_bars  # None: on a terminal
            self.run_dir = build.run_dir_of(self.cfg)
            (self.run_dir / "config.yaml").write_text(trainer_config.to_yaml(self.cfg))
            self.reward_funcs = (
                reward_functions.pack_reward_funcs(funcs, reward_weights, self.cfg.trainer.total_steps)
                if funcs is not None
                else None
            )
            inputs.check_reward_source(self.cfg, self.reward_funcs)
            self.multi_turn = inputs.multi_turn_setup(self.cfg, tools, environment)
            self.tokenizer_path = build.materialize_tokenizer(self.cfg, self.run_dir)
            inputs.check_reward_tokenizer(self.cfg, self.tokenizer_path)
            self.model_paths = build.materialize_models(self.cfg, self.run_dir, self.tokenizer_path)
            self.data = trainer_data.build_trainer_data(
                self.cfg, tokenizer_io.load_tokenizer(self.tokenizer_path), self.reward_funcs, self.multi_turn
            )
            for fn in funcs or ():
                reward_functions.check_reward_signature(fn, set(self.data.columns) - {"prompt"})
            rule_reward = "reward" not in self.cfg.models and self.data.reward_fn is not None
            self.graph = build.build_dataflow(self.cfg, rule_reward)
            self.cfg.trainer.check_profile_calls(list(self.graph.nodes))
            self.callbacks = trainer_callbacks.Callbacks(
                callbacks, trainer_callbacks.training_args(self.cfg, self.run_dir), steps_per_epoch=len(self.data.train)
            )
            self.launched, self._started_ray = False, False
            self.step = 0  # a failure while the first launch starts the workers restarts from here
            self._last_saved: Path | None = None  # the newest checkpoint this trainer wrote (a restart resumes it)
            self._signal: int | None = None  # SIGINT/SIGTERM received during training (checkpoint.save_on_signal)
            self._target_reached = False  # an evaluation of the loop reached trainer.target_score
            # placement.calibrate=run on a new shape: the calibration still to make, and the plan a
            # calibration chose to restart on.
            self._calibration: calibration.RunCalibration | None = None
            # a multi-turn generate call's seconds per episode step, at every step (the calibration reads them)
            self._tool_seconds: dict[str, list[float]] = {}
            self._rounds: list[float] = []  # dynamic sampling's generation rounds at every step (the same)
            self._next_placement: Placement | None = None
            self._first_step_s = 0.0
            # Seconds of each start-up stage, logged once with the first step (``startup/*``).
            self.startup: dict[str, float] | None = {"startup/construct_s": time.perf_counter() - self._created}
        except BaseException:
            if self._ray_start is not None:
                self._ray_start.stop()  # bad input leaves no Ray behind
            raise

    def _build_config(
        self, config, overrides, algorithm, model, tokenizer, train_dataset, eval_dataset, reward_model=None
    ) -> RLFlowConfig:
        """The config with the Python inputs written into the run directory, every path absolute."""
        cfg = inputs.build_config(config, overrides, algorithm)
        cfg = build.resolve_model_paths(cfg)  # Hub ids to cached snapshots, before anything reads a model's files
        cfg = run_dirs.claim_run_dir(cfg)  # an earlier run's outputs: resumed, refused, replaced or kept apart
        run_dir = build.run_dir_of(cfg)
        cfg = inputs.with_model(cfg, model, run_dir)
        cfg = inputs.with_tokenizer(cfg, tokenizer, run_dir)
        cfg = inputs.with_datasets(cfg, train_dataset, eval_dataset, run_dir)
        cfg = inputs.with_reward_model(cfg, reward_model, run_dir)
        # Workers may run with another working directory (a joined cluster): hand them absolute paths.
        return build.resolve_paths(cfg)

    def launch(self) -> Trainer:
        """Takes over (or starts, or joins) Ray, profiles, plans and starts the workers; a second call does nothing.

        With ``placement.worker_host`` ``auto`` or ``driver`` and no Ray yet, it plans first and
        runs a plan of one worker in this process (no Ray); a larger plan starts Ray then.
        """
        if self.launched:
            return self
        cfg = self.cfg
        started = time.perf_counter()
        # The worker class's imports (the engines, HF's modeling code) while Ray may still be starting.
        from rlflow.workers.model_worker import ModelWorker  # noqa: F401

        self._record_startup("worker_imports_s", started)
        started = time.perf_counter()
        pending, self._ray_start = self._ray_start, None
        # A plan of one worker may run it here (placement.worker_host): Ray waits for the plan then.
        in_driver = pending is None and not self._started_ray and build.driver_may_host(cfg)
        if in_driver:
            build.local_ray_cpus(cfg)  # refuses more workers than cores, as a local Ray's start would
            self.use_gpu = build.local_uses_gpu(cfg)
        else:
            self._started_ray = build.ensure_ray(cfg, pending) or self._started_ray  # a relaunch joins its Ray
            self.use_gpu = build.uses_gpu(cfg)
        self._record_startup("ray_s", started)
        self.placement = self._plan()
        # Workers only for the ranks the plan uses (one worker may be the faster plan).
        ranks = build.worker_ranks(cfg, self.placement.used_ranks)
        if in_driver and len(ranks) > 1:  # worker_host 'auto' (config: 'driver' plans one device)
            in_driver, started = False, time.perf_counter()
            self._started_ray = build.ensure_ray(cfg)
            self._record_startup("ray_s", started)
        if self.startup is not None:
            self.startup["startup/worker_in_driver"] = float(in_driver)
        calls = {**self.placement.calls, **build.extra_calls(cfg, self.placement.calls, self.data.reward_fn, ranks)}
        setup = build.worker_setup(
            cfg,
            calls,
            self.model_paths,
            self.tokenizer_path,
            self.data.reward_fn,
            self.placement,
            self.use_gpu,
            multi_turn=self.multi_turn,
        )
        calls = build.with_hook_ranks(calls, setup)
        self.setup = setup
        started = time.perf_counter()
        self.workers, self.pool = build.start_workers(
            cfg, setup, self.use_gpu, ranks, in_driver=in_driver, threads=self.placement.threads
        )
        if cfg.trainer.profile_calls:  # a torch.profiler trace of each chosen call, per rank
            loop, directory = cfg.trainer, str(self.run_dir / "profiles")
            self.workers.set_profiler(worker_records.CallProfiler(loop.profile_calls, loop.profile_steps, directory))
        self._record_startup("workers_s", started)
        group_size = cfg.row_group_size()
        main = {n: calls[n] for n in self.placement.calls}
        self.runner = trainer_runner.DataflowRunner(self.workers, self.graph, main, row_group_size=group_size)
        # At most one of them (the config refuses both): DAPO's refills, or partial rollouts.
        self.sampler = dynamic_sampling.build_sampler(cfg, self.runner) or partial_rollouts.build_sampler(
            cfg, self.runner, setup.sampling
        )
        self.issuer = trainer_runner.LaggedIssuer(
            self.runner,
            self.cfg.algorithm.policy_lag,
            self.cfg.trainer.total_steps,
            sample=None if self.sampler is None else self.sampler.sample,
        )
        extra = {n: c for n, c in calls.items() if n not in self.placement.calls}
        self.side_runner = _side_runner(self.workers, extra) if extra else None
        self.logger = trainer_callbacks.NotifyingLogger(
            trainer_metrics.MetricsLogger(cfg.logging, self.run_dir, run_config=_plain(cfg)), self.callbacks
        )
        self.checkpoints = trainer_checkpoint.CheckpointManager(cfg.checkpoint, self.run_dir)
        self.step = 0
        self.result = FitResult(
            steps=0, run_dir=str(self.run_dir), estimated_seconds=self.placement.estimated_call_seconds()
        )
        self._intervals: list[Interval] = []
        self._records: list[CallRecord] = []  # popped records of issued steps not logged yet
        self._metric_pops: dict[int, list[ray.ObjectRef]] = {}  # step -> the pop queued behind its calls
        self.launched = True
        return self

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ building
    def _plan(self) -> Placement:
        if self._next_placement is not None:  # a calibration chose it; the run resumes on it
            placement, self._next_placement = self._next_placement, None
            (self.run_dir / "plan.json").write_text(placement.plan.to_json())
            log.info(placement.plan.to_table())
            return placement
        values = {n for n in self.cfg.models if n in build.VALUE_ROLES}
        lora = {n: m.lora for n, m in self.cfg.models.items() if m.lora is not None}
        specs = trainer_placement.model_specs(self.model_paths, values, lora, self.cfg.placement.keep_copies)
        actor = specs.get("actor", next(iter(specs.values()), None))
        started = time.perf_counter()
        found = trainer_placement.load_profile_for(self.cfg, self.use_gpu, self.run_dir, actor, self.progress_bars)
        if found is not None and self.startup is not None:  # None once logged (a relaunch after a restart)
            self._record_startup("profile_s", started)
            self.startup["startup/profile_cached"] = float(found.cached)
        if found is not None and found.calibrate_to is not None:
            paths = (found.calibrate_to, self.run_dir / "profile.json")
            self._calibration = calibration.RunCalibration(found.profile, paths, specs, self.multi_turn is not None)
        started = time.perf_counter()
        placement = trainer_placement.plan_placement(
            self.cfg,
            self.graph,
            specs,
            use_gpu=self.use_gpu,
            profile=None if found is None else found.profile,
            progress=self.progress_bars,
            multi_turn=self.multi_turn is not None,
            calibrates=self._calibration is not None,
        )
        self._record_startup("plan_s", started)
        if found is not None and self._calibration is None and self.cfg.placement.calibrate == "run":
            kinds = {m.name: m.interface_type for m in dataflow.mfcs_of(self.graph)}
            unchecked = calibration.uncalibrated_kinds(placement, kinds, found.profile)
            if unchecked:  # a plan priced where no run of the shape measured: this run's calls calibrate it
                log.info(
                    f"profile: the plan runs {', '.join(unchecked)} calls in a regime no run of these shapes "
                    f"calibrated; the run's own first calls calibrate it, cached at {found.path}"
                )
                paths = (found.path, self.run_dir / "profile.json")
                self._calibration = calibration.RunCalibration(found.profile, paths, specs, self.multi_turn is not None)
        if placement.plan is not None:
            (self.run_dir / "plan.json").write_text(placement.plan.to_json())
            log.info(placement.plan.to_table())
            for b in placement.baselines:
                est = "infeasible: " + b.reason if not b.feasible else f"{b.iteration_time_s:.3f} s/iteration"
                log.info(f"  baseline {b.name:<10} {est}")
        return placement

    def _record_startup(self, stage: str, started: float) -> None:
        if self.startup is not None:  # None once logged (a launch after the first step)
            self.startup[f"startup/{stage}"] = time.perf_counter() - started

    # ------------------------------------------------------------------ the loop
    def fit(self) -> FitResult:
        """Launches when not yet launched, runs the configured number of steps (fewer when a
        callback stops it); returns scores, timings and where files went.

        Recovery: with ``trainer.max_restarts`` > 0, a worker that dies or a collective that
        fails (:func:`is_recoverable`) makes the driver stop every worker, start them again and
        resume from the newest checkpoint this run wrote (else what ``checkpoint.resume`` names),
        at most that many times. With ``checkpoint.save_on_signal``, SIGINT or SIGTERM during
        training ends the run after the step in flight with a checkpoint, then raises
        ``KeyboardInterrupt`` (SIGINT) or ``SystemExit(143)`` (SIGTERM).
        """
        restarts, replanned, fresh = 0, False, self._driver_state()
        while True:
            try:
                self.launch()
                self._resume(self._last_saved if restarts or replanned else None)
                if restarts:
                    if self._last_saved is None and self.step == 0:
                        self.logger.rewind(-1)  # starting over: what the failed attempt logged goes
                    self.logger.log(self.step, {"trainer/restarts": restarts})
                self._run(begin=not replanned)
                break
            except _Replan as replan:  # the calibrated plan: resume on it from the checkpoint just saved
                self._stop_workers()
                self._next_placement, replanned = replan.placement, True
            except (controller.WorkerDiedError, controller.WorkerError) as err:
                if restarts >= self.cfg.trainer.max_restarts or not is_recoverable(err):
                    raise
                restarts += 1
                self._restart(err, restarts)
                if self._last_saved is None:  # no checkpoint to resume: start over as the first launch did
                    self._restore_driver_state(fresh)
        self._report()
        return self.result

    def _run(self, begin: bool = True) -> None:
        """The stages after launch and resume: the fresh run's evaluation, warm-up and copies,
        training, the final evaluation and checkpoint; ``begin``: tell the callbacks training
        begins (not again when the run resumes on a calibrated plan)."""
        if begin:
            self.callbacks.train_begin(self.step)
        if self.step == 0:
            if self.cfg.trainer.eval_before_train:
                self.evaluate()
            if self.data.warmup is not None and self.side_runner is not None:
                score = self._warmup()  # the held-out score at its last step, when it evaluated there
                if score is None:
                    self.evaluate()
                else:
                    self._record_eval(score)
            self._copy_models()
        self.result.score_before = self.result.eval_history[-1][1] if self.result.eval_history else None
        with self._signals_stop_training():
            self._train()
        if self._signal is not None:
            self._exit_on_signal()
        self.result.score_after = self.evaluate()
        self._save(final=True)
        self._save_final_models()
        self.callbacks.train_end(self.step)

    def _restart(self, err: Exception, attempt: int) -> None:
        """Stops every worker after a recoverable failure; :meth:`fit` then launches and resumes."""
        source = self._last_saved or f"checkpoint.resume={self.cfg.checkpoint.resume!r}"
        reason = str(err).splitlines()[0]
        message = (
            f"restart {attempt}/{self.cfg.trainer.max_restarts} at step {self.step}: {type(err).__name__}: {reason}; "
            f"starting the workers again and resuming from {source}"
        )
        log.warning(message)
        self._stop_workers()

    def _driver_state(self) -> dict[str, Any]:
        """The driver's RNG states and data-loader position (a restart with no checkpoint starts from them)."""
        return {"rng": trainer_checkpoint.capture_rng_state(), "data": self.data.train.state_dict()}

    def _restore_driver_state(self, state: Mapping[str, Any]) -> None:
        trainer_checkpoint.restore_rng_state(state["rng"])
        self.data.train.load_state_dict(state["data"])

    @contextmanager
    def _signals_stop_training(self) -> Iterator[None]:
        """While it trains, SIGINT and SIGTERM ask the loop to stop after the step in flight
        (``checkpoint.save_on_signal``); a second signal acts at once, as it would without rlflow."""
        if not self.cfg.checkpoint.save_on_signal or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def stop(signum: int, frame: Any) -> None:
            if self._signal is not None:
                signal.signal(signum, previous[signum] or signal.SIG_DFL)
                signal.raise_signal(signum)
                return
            self._signal = signum
            log.warning(f"{signal.Signals(signum).name}: saving a checkpoint after the step in flight, then exiting")

        for sig in previous:
            signal.signal(sig, stop)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _exit_on_signal(self) -> None:
        """Saves the step reached and leaves as the signal would have (a shell sees 130 or 143)."""
        path = self._save()
        self._save_final_models()
        name = signal.Signals(self._signal).name
        log.warning(f"{name}: stopped at step {self.step}; checkpoint {path}")
        if self._signal == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + self._signal)

    def _train(self) -> None:
        total, loop = self.cfg.trainer.total_steps, self.cfg.trainer
        started = time.time()
        batches = self._batches()
        bar = trainer_metrics.progress(total - self.step, "train", show=self.progress_bars)
        if self._calibration is not None:  # phases of placement.calibrate_steps after the first step
            p = self.cfg.placement
            self._calibration.begin(self.step, self.placement, p.calibrate_steps, p.devices_per_node)
        pending: tuple[int, Submitted] | None = None
        while self.step < total or pending is not None:
            if pending is None:
                pending = (self.step + 1, self._issue(self.step + 1, batches))
            step, submitted = pending
            # Overlap: issue the next iteration before waiting when no evaluation or checkpoint
            # needs the workers quiet at this step (ReaLHF's cross-iteration overlap).
            following = None
            if step < total and not self._sync_point(step) and not self._stopping(started):
                following = (step + 1, self._issue(step + 1, batches))
            self._write_rollouts(step, self.runner.wait(submitted, fetch=self._rollout_calls(step)))
            self.step = step
            self.callbacks.step_end(step)
            self._log_step(step)
            bar.update(1)
            pending = following
            if self._calibration is not None and self._calibration.due(step) and step < total:
                self._calibrate(step)
            if self._sync_point(step):
                if loop.eval_every and step % loop.eval_every == 0 and step < total:
                    self._note_target(self.evaluate())
                if self.cfg.checkpoint.every_n_steps and step % self.cfg.checkpoint.every_n_steps == 0:
                    self._save()
            if pending is None and self._stopping(started):
                break
        self.issuer.drain()  # rollouts issued ahead of a run that stopped early
        bar.close()
        self.result.steps = self.step

    def _rollout_calls(self, step: int) -> list[str]:
        """The calls whose rows ``step`` writes (``logging.rollouts_every``); none on other steps."""
        every = self.cfg.logging.rollouts_every
        return self._rollout_log_calls if every and step % every == 0 else []

    @cached_property
    def _rollout_log_calls(self) -> list[str]:
        """The first generate call and the call that scores its rows (the producer of ``rewards``), if any."""
        mfcs = [self.runner.placements[n].mfc for n in self.runner.order]
        generate = next(m.name for m in mfcs if m.interface_type == "generate")
        scores = [m.name for m in mfcs if "rewards" in m.output_keys and m.interface_type == "inference"]
        return [generate, *scores[:1]]

    @cached_property
    def _rollout_log_tokenizer(self):
        return tokenizer_io.load_tokenizer(self.tokenizer_path)

    def _write_rollouts(self, step: int, rows: dict[str, DataProto]) -> None:
        if not rows:
            return
        generate, *scores = self._rollout_log_calls
        records = rollout_log.rollout_records(
            self._rollout_log_tokenizer, rows[generate], rows[scores[0]] if scores else None
        )
        rollout_log.write_rollouts(self.run_dir, step, records)

    def _issue(self, step: int, batches) -> Submitted:
        """Issues ``step``'s calls, then a ``pop_metrics`` queued behind them on every worker: it
        runs as soon as the step's calls are done there, and never waits for the calls issued
        later (a blocking pop at log time would wait for the next step's too, and so serialise
        the overlap of steps)."""
        submitted = self.issuer.issue(step, batches)
        self._metric_pops[step] = self.workers.async_execute_all("pop_metrics")
        return submitted

    def _sync_point(self, step: int) -> bool:
        every = [self.cfg.trainer.eval_every, self.cfg.checkpoint.every_n_steps]
        # nothing issued past a calibration phase: the plan or the workers' threads may change there
        calibrating = self._calibration is not None and self._calibration.due(step)
        return step >= self.cfg.trainer.total_steps or calibrating or any(e and step % e == 0 for e in every)

    def _calibrate(self, step: int) -> None:
        """Ends a phase of the run's calibration (:class:`calibration.RunCalibration`): sets the
        worker threads of the next phase, or takes the decision — the running plan on its faster
        thread count, or (a checkpoint saved first) :class:`_Replan` to restart on another."""
        outcome = self._calibration.at(
            step, self.cfg, self.graph, self.placement, self.result.mfc_seconds, restart_s=self._first_step_s,
            tool_seconds=self._tool_seconds, rounds=self._rounds,
        )  # fmt: skip
        if isinstance(outcome, int):
            log.info(f"calibrating: steps {step + 1}..{step + self.cfg.placement.calibrate_steps} on {outcome} threads")
            self.workers.execute_all("set_threads", outcome)
            return
        self._calibration = None
        log.info(outcome.message)
        self.logger.log(step, outcome.metrics)
        if outcome.restart:
            self._save()
            raise _Replan(outcome.placement)
        if outcome.placement is not None:
            self.workers.execute_all("set_threads", outcome.placement.threads)
            self.placement = outcome.placement
            self.result.estimated_seconds = outcome.placement.estimated_call_seconds()
            (self.run_dir / "plan.json").write_text(outcome.placement.plan.to_json())

    def _stopping(self, started: float) -> bool:
        """Whether the loop stops before ``trainer.total_steps``: past ``trainer.max_wall_seconds``, at
        ``trainer.target_score``, asked by a callback or by a signal."""
        limit = self.cfg.trainer.max_wall_seconds
        out_of_time = limit is not None and time.time() - started > limit
        return out_of_time or self._target_reached or self.callbacks.stop_requested or self._signal is not None

    def _note_target(self, score: float | None) -> None:
        target = self.cfg.trainer.target_score
        if score is not None and target is not None and score >= target:
            self._target_reached = True
            log.info(f"step {self.step}: held-out score {score:.3f} reached trainer.target_score {target}; stopping")

    def _batches(self):
        while True:
            yield from self.data.train

    # ------------------------------------------------------------------ stages
    def _warmup(self) -> float | None:
        """SFT steps on the actor's home layout before RL (the main job's warm-up).

        Runs ``warmup.steps`` steps, evaluating every ``warmup.eval_every`` of them (logged at
        step 0 as ``warmup/step``, ``warmup/eval_score``, ``warmup/loss``), and stops early
        once the held-out score reaches ``warmup.target_score``.

        Returns:
            The held-out score after the last step taken when the warm-up evaluated there, else None.
        """
        w = self.cfg.warmup
        bar = trainer_metrics.progress(w.steps, "sft warm-up", show=self.progress_bars)
        batches = iter(self._cycle(self.data.warmup))

        def submit() -> Submitted:
            return self.side_runner.submit(
                next(batches), [build.WARMUP_SFT], {build.WARMUP_SFT: {"lr": w.lr}}, step=self.step
            )

        losses: list[float] = []
        score, reached, taken = None, False, 0
        following: Submitted | None = None
        for taken in range(1, w.steps + 1):
            submitted = following or submit()
            evaluates = bool(w.eval_every) and taken % w.eval_every == 0
            # The next step queues behind this one on the workers before the driver waits, so the
            # workers never idle on the driver's round trip; not past an evaluation, which must see
            # this step's weights and may end the warm-up (the same steps and batches either way).
            following = submit() if taken < w.steps and not evaluates else None
            self.side_runner.wait(submitted)
            bar.update(1)
            score = None
            if evaluates:
                recent = self._warmup_losses()
                losses += recent
                score = self._warmup_eval(taken, recent)
                reached = score is not None and w.target_score is not None and score >= w.target_score
                if reached:
                    break
        bar.close()
        losses += self._warmup_losses()
        self.result.warmup_steps = taken
        if losses:
            target = f"; held-out score {score:.3f} reached the target {w.target_score}" if reached else ""
            log.info(f"sft warm-up: {taken} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}{target}")
        return score

    def _warmup_eval(self, taken: int, recent_losses: list[float]) -> float | None:
        """One evaluation inside the warm-up, logged with the mean loss of the steps since the previous one."""
        score = self._held_out_score()
        if score is not None:
            self.result.warmup_history.append((taken, score))
            metrics = {"warmup/step": taken, "warmup/eval_score": score}
            if recent_losses:
                metrics["warmup/loss"] = float(np.mean(recent_losses))
            self.logger.log(self.step, metrics)
        return score

    def _warmup_losses(self) -> list[float]:
        records = self._pop_metrics()
        return [r.metrics["loss"] for r in records if r.mfc == build.WARMUP_SFT and "loss" in r.metrics]

    def _copy_models(self) -> None:
        """``init: copy`` models take their source's weights as RL starts (after the warm-up).

        Home to home on the workers (``ModelWorker.copy_weights``); a critic copies the actor's
        backbone and keeps its value head. Once per run: checkpoints hold the copies.
        """
        hosted = {name for name, m in self.setup.models.items() if not m.rule_based}
        for name, m in self.cfg.models.items():
            if m.init != "copy" or name not in hosted or m.init_from not in hosted:
                continue
            kept = sorted({p for per_rank in self.workers.copy_weights(name, m.init_from) for p in per_rank})
            own = f", keeping its own {', '.join(kept)}" if kept else ""
            log.info(f"{name}: copied from {m.init_from} at RL start{own}")

    @staticmethod
    def _cycle(loader):
        while True:
            yield from loader

    def evaluate(self) -> float | None:
        """Greedy (or sampled) answers to the held-out prompts, scored by the rule reward; recorded and logged.

        Launches the trainer when it is not yet launched.

        Returns:
            the mean score (the accuracy for 0/1 rewards), or ``None`` without held-out data.
        """
        return self.launch()._record_eval(self._held_out_score())

    def _held_out_score(self) -> float | None:
        if (
            self.data.eval_prompts is None
            or self.side_runner is None
            or build.EVAL_GEN not in self.side_runner.placements
        ):
            return None
        submitted = self.side_runner.submit(
            self.data.eval_prompts,
            [build.EVAL_GEN, build.EVAL_REWARD],
            {build.EVAL_GEN: {"evaluate": True}},
            step=self.step,
        )
        out = self.side_runner.wait(submitted, fetch=[build.EVAL_REWARD])[build.EVAL_REWARD]
        return float(out.batch["rewards"].float().mean())

    def _record_eval(self, score: float | None) -> float | None:
        if score is not None:
            self.result.eval_history.append((self.step, score))
            self.logger.log(self.step, {"eval/score": score})
            self.callbacks.evaluate(self.step, {"eval/score": score})
        return score

    def _log_step(self, step: int) -> None:
        """Logs the records of ``step``'s calls (each record carries the step its call was issued for).

        Records of a later, already issued step wait for it; those of an earlier step (the
        evaluation after a step's log, the warm-up) are only drawn in the timeline.
        """
        queued = self._metric_pops.pop(step, None)
        self._records.extend(self._pop_metrics(queued))
        mine = [r for r in self._records if r.step == step]
        self._records = [r for r in self._records if r.step > step]
        metrics = trainer_metrics.call_metrics(mine)
        if self.sampler is not None:  # the step's generation rounds and dropped groups
            metrics.update(self.sampler.metrics.pop(step, {}))
            if "dynamic_sampling/rounds" in metrics:
                self._rounds.append(metrics["dynamic_sampling/rounds"])
        for name in dict.fromkeys(r.mfc for r in mine if r.kind == "call"):
            self.result.mfc_seconds.setdefault(name, []).append(metrics[f"time/{name}"])
            if metrics.get(f"{name}/multi_turn/turns"):
                per_step = metrics[f"{name}/multi_turn/step_s"] / metrics[f"{name}/multi_turn/turns"]
                self._tool_seconds.setdefault(name, []).append(per_step)
        if self.startup is not None:  # once: how long this run took to reach its first step
            self._first_step_s = time.perf_counter() - self._created
            self.startup["startup/first_step_s"] = self._first_step_s
            self.logger.log(step, self.startup)
            self.startup = None
        if step % self.cfg.trainer.log_every == 0 or step == self.cfg.trainer.total_steps:
            self.logger.log(step, metrics)

    def _pop_metrics(self, queued: list[ray.ObjectRef] | None = None) -> list[CallRecord]:
        """Per-call records of every worker since the last pop (or those of a pop ``queued`` by
        :meth:`_issue`); also feeds the measured timeline."""
        popped = self.workers.get(queued) if queued is not None else self.workers.pop_metrics()
        records = [r for per_rank in popped for r in per_rank]
        self._intervals += [timeline.Interval(r.rank, r.start, r.end, r.mfc, r.interval_kind, r.step) for r in records]
        return records

    def _save_final_models(self) -> None:
        """The trained models as HF directories (weights, tokenizer, generation config) in
        ``checkpoint.final_dir``, apart from the rotating checkpoints."""
        names = [name for name, model in self.setup.models.items() if model.trainable]
        directory = trainer_checkpoint.final_dir(self.cfg.checkpoint, self.run_dir)
        paths = trainer_checkpoint.save_final_models(self.workers.save_pretrained, names, directory)
        log.info(f"final models at step {self.step}: {', '.join(str(p) for p in paths)}")

    def _save(self, final: bool = False) -> Path | None:
        if final and not self.cfg.checkpoint.save_final:
            return None

        def write(directory: Path) -> None:
            self.workers.save_checkpoint(str(directory), self.cfg.checkpoint.save_hf)
            ahead = self.issuer.save(directory / AHEAD_DIR)
            plan = self.placement.plan.to_json() if self.placement.plan is not None else None
            checkpoint_layouts.write_layouts(
                directory, checkpoint_layouts.home_layouts(self.setup, range(self.workers.world_size)), plan
            )
            trainer_checkpoint.write_trainer_state(
                directory,
                step=self.step,
                data_state=self.data.train.state_dict(),
                extra={
                    "eval_history": self.result.eval_history,
                    "warmup_history": self.result.warmup_history,
                    "warmup_steps": self.result.warmup_steps,
                    "rollouts_ahead": ahead,
                    "partial_rollouts": self._save_partial(directory / PARTIAL_DIR),
                },
            )

        identities = run_dirs.model_identities(self.cfg)  # what a resume must match
        self._last_saved = self.checkpoints.save(self.step, write, extra_meta={"models": identities})
        if self._last_saved is not None:
            self.callbacks.save(self.step)
        return self._last_saved

    def _save_partial(self, directory: Path) -> dict | None:
        """The carried and finished rows of partial rollouts, written under ``directory``; None without them."""
        if not isinstance(self.sampler, partial_rollouts.PartialRollouts):
            return None
        return self.sampler.save(directory)

    def _resume(self, checkpoint: Path | None = None) -> None:
        """Restores ``checkpoint`` (default: what ``checkpoint.resume`` names, if anything) into
        this run, whatever layouts it was written in (:meth:`_load_workers`)."""
        path = checkpoint or self.checkpoints.resolve_resume(self.cfg.checkpoint.resume)
        if path is None:
            return
        state = trainer_checkpoint.read_trainer_state(path)
        self._load_workers(path)
        self.data.train.load_state_dict(state["data"])
        trainer_checkpoint.restore_rng_state(state["rng"])
        self.step = int(state["step"])
        self.logger.rewind(self.step)  # the interrupted run's records after this step are re-run
        self.result.eval_history = [tuple(e) for e in state["extra"].get("eval_history", [])]
        self.result.warmup_history = [tuple(e) for e in state["extra"].get("warmup_history", [])]
        self.result.warmup_steps = int(state["extra"].get("warmup_steps", 0))
        self.issuer.load(path / AHEAD_DIR, state["extra"].get("rollouts_ahead", []))
        partial = state["extra"].get("partial_rollouts")
        if partial is not None and isinstance(self.sampler, partial_rollouts.PartialRollouts):
            self.sampler.load(path / PARTIAL_DIR, partial)
        elif partial is not None and any((path / PARTIAL_DIR).glob("*.safetensors")):
            log.warning(
                f"{path} holds the rows of partial rollouts (responses carried between steps, finished groups "
                f"waiting); this run has rollout.partial_tokens={self.cfg.rollout.partial_tokens}: they are dropped "
                "and the run samples afresh (resume with the checkpoint's rollout.partial_tokens to continue them)"
            )
        log.info(f"resumed from {path} at step {self.step}")

    def _load_workers(self, path: Path) -> None:
        """Workers load ``path`` directly when this run's home layouts are the checkpoint's, else
        from a scratch directory of resharded engine files (:mod:`rlflow.trainer.checkpoint_layouts`)."""
        configs = {}
        for name, model in self.setup.models.items():
            if model.trainable:
                configs[name] = transformers.AutoConfig.from_pretrained(model.path, local_files_only=True)
                if model.value_head:  # as the workers build a value model: one label
                    configs[name].num_labels = 1
        layouts = checkpoint_layouts.home_layouts(self.setup, range(self.workers.world_size))
        source = checkpoint_layouts.checkpoint_for_layouts(
            path, layouts, configs, self.checkpoints.scratch_dir(path.name)
        )
        try:
            self.workers.load_checkpoint(str(source))
        finally:
            if source != path:
                checkpoint_layouts.remove_scratch(source)

    def _report(self) -> None:
        """Measured vs estimated time per MFC, and the measured timeline as a picture and a Perfetto / Chrome trace."""
        table = trainer_metrics.timing_table(self.result.mfc_seconds, self.result.estimated_seconds)
        log.info(table)
        (self.run_dir / "timings.txt").write_text(table + "\n")
        if self._intervals:
            t0 = min(i.start for i in self._intervals)
            shifted = [replace(i, start=i.start - t0, end=i.end - t0) for i in self._intervals]
            ends: dict[int, float] = defaultdict(float)  # the last record of each training step
            for i in shifted:
                if i.iteration:
                    ends[i.iteration] = max(ends[i.iteration], i.end)
            timeline.draw_timeline(
                shifted,
                self.run_dir / "timeline.png",
                title=f"{self.cfg.experiment_name}: measured",
                boundaries=sorted(ends.values()),
            )
            strategies = {name: layout.strategy for name, layout in self.setup.layouts.items()}
            timeline.write_trace(
                shifted, self.run_dir / "timeline.trace.json", f"{self.cfg.experiment_name}: measured", strategies
            )

    def close(self) -> None:
        """Stops the workers, hands their placement groups back to Ray, closes the metric sinks,
        and shuts down a Ray instance this trainer started (idempotent; nothing to do before launch)."""
        self._stop_workers()
        if self._ray_start is not None:  # constructed, never launched
            self._ray_start.stop()
            self._ray_start = None
        if self._started_ray:
            self._started_ray = False
            ray.shutdown()

    def _stop_workers(self) -> None:
        if self.launched:
            self.launched = False
            self.logger.close()
            self.workers.shutdown()
            if self.pool is not None:  # None: the worker ran in this process
                self.pool.release()


# Error text of a collective that failed or hung: a peer died (gloo sees its socket close) or
# torch's collective timeout passed. Worth a restart, unlike an error of the computation itself.
COLLECTIVE_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "NCCL")


class _Replan(Exception):
    """Raised at a calibration step that chose another plan; :meth:`Trainer.fit` restarts on it."""

    def __init__(self, placement: Placement):
        super().__init__(f"re-planned: {placement.plan.name}")
        self.placement = placement


def is_recoverable(err: Exception) -> bool:
    """Whether a restart from the last checkpoint may get past ``err``: a dead worker, or a
    collective that failed because a peer died or hung (:data:`COLLECTIVE_FAILURES`)."""
    if isinstance(err, controller.WorkerDiedError):
        return True
    return isinstance(err, controller.WorkerError) and any(marker in str(err) for marker in COLLECTIVE_FAILURES)


# Where a checkpoint keeps the rollouts issued ahead of its step (algorithm.policy_lag > 0).
AHEAD_DIR = "rollouts_ahead"
# Where it keeps the responses partial rollouts carry to later steps (rollout.partial_tokens > 0).
PARTIAL_DIR = "partial_rollouts"


def _side_runner(workers, calls) -> DataflowRunner:
    """A runner for the evaluation and warm-up calls, which are not part of the algorithm's graph."""
    from rlflow.dataflow import build_graph

    return trainer_runner.DataflowRunner(workers, build_graph([c.mfc for c in calls.values()]), calls)


def _plain(cfg: RLFlowConfig) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


__all__ = ["FitResult", "Trainer", "is_recoverable"]
