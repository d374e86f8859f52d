"""The colocated model worker: one Ray actor per device hosting every model the plan puts there.

The driver builds one :class:`ModelWorker` per device of the resource pool (all with the same
:class:`~rlflow.workers.setup.WorkerSetup`) and drives it in this order::

    group = RayWorkerGroup(pool, RayClassWithInitArgs(ModelWorker, setup))
    group.init_process_group()                      # all ranks: the pool's default group
    group.build()                                   # all ranks: process groups, engines
    group.copy_weights("ref", "actor")              # once at RL start, per ``init: copy`` model
    for each iteration, for each MFC in topological order (non-blocking):
        hooks = group.view(setup.hook_ranks(name))  # skip when empty
        hooks.async_execute_all("pre_call", name, step)
        call = group.view(layout.ranks, layout.strategy, row_group_size=...)  # GRPO/RLOO: n_samples; DPO/RM: 2
        out = call.<generate|inference|train_step>(name, *inputs, step=step)  # MESH_PROTO, returns a DataFuture
        hooks.async_execute_all("post_call", name, step)

Each actor runs its calls in issue order, so the hooks of a call see the weights after every
train step issued before it. ``generate`` / ``inference`` / ``train_step`` take the MFC's
input rows (several producers' rows arrive row-aligned and are unioned), apply the MFC's
``input_key_remap``, run the role interface on this rank's rows, and return the MFC's output
keys (``output_key_remap`` applied) from the tp-rank-0 ranks of the last pipeline stage —
other ranks return ``None``, which MESH_PROTO does not collect. A ``train_step`` returns a
row-less ``DataProto`` whose ``meta_info`` holds its metrics.

Every output's ``meta_info`` holds ``mfc``, ``time_s`` (slowest dp rank), ``tokens`` (real
tokens of the call's rows), ``rows``, ``peak_memory_bytes`` (CUDA peak of the call, or the
process's peak RSS on CPU) and the interface's metrics reduced over the dp ranks, identical in
every part so that the parts concatenate. Every rank also keeps one
:class:`~rlflow.workers.records.CallRecord` per call and hook it ran, tagged with the ``step``
the driver issued it for, which :meth:`ModelWorker.pop_metrics` hands to the driver (step
metrics, timelines). An exception inside a call or hook reaches the driver as an error that
starts with the call, its model and the rank (``reward_inf (model reward) on rank 1: ...``).
Calls the driver chose (``set_profiler``) run under ``torch.profiler`` and leave a Chrome trace.

Checkpoints: ``save_checkpoint(dir)`` / ``load_checkpoint(dir)`` on all ranks (ONE_TO_ALL) at a
quiet point (no call in flight); ``save_pretrained(model, dir)`` exports HF weights.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from rlflow.controller import Dispatch, Worker, register
from rlflow.dataflow.mfc import MFCDef
from rlflow.engine.rollout.partial import PartialCall
from rlflow.protocol import DataProto
from rlflow.workers.context import CallContext
from rlflow.workers.hf_export import complete_hf_export
from rlflow.workers.interfaces import build_interface, check_calls
from rlflow.workers.interfaces.actor import POLICY_LAG, POLICY_VERSION, row_versions, token_lag_metrics
from rlflow.workers.logs import configure_logging
from rlflow.workers.records import CallProfiler, CallRecord, call_error
from rlflow.workers.residency import Residency
from rlflow.workers.rows import (
    carried_rows,
    dataflow_rows,
    interface_rows,
    num_tokens,
    peak_memory_bytes,
    reduce_metrics,
)
from rlflow.workers.setup import WorkerSetup

if TYPE_CHECKING:
    from rlflow.engine.train_engine import TrainEngine

__all__ = ["FROZEN_WEIGHTS", "ModelWorker"]

# A checkpoint's file of a frozen model whose weights changed during the run (EMA or copied reference).
FROZEN_WEIGHTS = "weights.safetensors"


class ModelWorker(Worker):
    """Hosts the plan's models on one device and serves their MFCs (module docstring).

    Args:
        setup: identical on every worker of the pool.
    """

    def __init__(self, setup: WorkerSetup) -> None:
        if not isinstance(setup, WorkerSetup):
            raise TypeError(f"ModelWorker needs a WorkerSetup, got {type(setup).__name__}")
        check_calls(setup)
        configure_logging(setup.log_level)  # a Ray worker's messages reach the driver through its stdout
        self.setup = setup
        self.interfaces = {name: build_interface(model, setup) for name, model in setup.models.items()}
        self.residency: Residency | None = None
        self._records: list[CallRecord] = []
        self._copied: set[str] = set()  # models that took another's weights (copy_weights)
        self._profiler = CallProfiler((), (), "")  # profiles nothing until set_profiler

    # ------------------------------------------------------------------ lifecycle
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def build(self) -> dict:
        """Create the plan's process groups and this rank's engines; all ranks, after ``init_process_group``.

        Returns:
            ``{"rank", "models": [names with weights here], "memory_bytes"}``.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "ModelWorker.build needs torch.distributed: call init_process_group() on the group first"
            )
        torch.manual_seed(self.setup.seed)
        self.residency = Residency(self.setup, self.rank, self.device)
        self.residency.build(self.info.node_rank)
        return {
            "rank": self.rank,
            "models": self.residency.held_models(),
            "memory_bytes": self.residency.memory_bytes(),
        }

    def close(self) -> None:
        """Drops this worker's engines and the process groups cached for its calls (a driver-hosted
        worker's host calls it before destroying the default group; a Ray actor's process just ends)."""
        from rlflow.engine.rollout.pipelined import clear_back_groups
        from rlflow.parallel.groups import clear_group_cache

        self.residency = None
        self._records.clear()
        clear_group_cache()
        clear_back_groups()

    def _residency(self) -> Residency:
        if self.residency is None:
            raise RuntimeError("ModelWorker.build() has not run on this worker")
        return self.residency

    def _mfc(self, name: str, kind: str | None = None) -> MFCDef:
        if name not in self.setup.mfcs:
            raise KeyError(f"unknown MFC {name!r}; the setup has {sorted(self.setup.mfcs)}")
        mfc = self.setup.mfcs[name]
        if kind is not None and mfc.interface_type != kind:
            raise ValueError(f"MFC {name!r} is a {mfc.interface_type} call, not {kind}")
        return mfc

    # ------------------------------------------------------------------ hooks
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pre_call(self, mfc_name: str, step: int) -> None:
        """Reallocation pre-hook of ``mfc_name`` for the call of ``step`` (ranks outside
        ``setup.hook_ranks`` return at once)."""
        self._hook("pre_call", self._mfc(mfc_name), self._residency().prepare, step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def post_call(self, mfc_name: str, step: int) -> None:
        """Reallocation post-hook: post-hooks, then free the call's copy unless its model is in ``keep_copies``."""
        self._hook("post_call", self._mfc(mfc_name), self._residency().release, step)

    def _hook(self, hook: str, mfc: MFCDef, run, step: int) -> None:
        if self.rank not in self.setup.hook_ranks(mfc.name):
            return
        stats = self._residency().manager.stats
        before, start = dict(stats), time.time()
        try:
            run(mfc)
        except Exception as exc:
            raise call_error(mfc.name, mfc.model_name, hook, self.rank, exc) from exc
        # realloc_skipped: calls whose kept copy was current, so the hook moved no weights.
        moved = {
            f"realloc_{k}": stats[k] - before[k]
            for k in (
                "reshards",
                "reshard_seconds",
                "sent_bytes",
                "received_bytes",
                "sent_intra_host_bytes",
                "sent_inter_host_bytes",
                "copied_bytes",
                "skipped",
            )
        }
        # Timeline kinds (rlflow.planner.timeline): weights moved between layouts, or a home reloaded/offloaded.
        interval_kind = "reload" if self.setup.uses_home(mfc.name) and not mfc.hook_sources else "realloc"
        self._record(mfc, hook, interval_kind, step, start, moved)

    def _record(
        self, mfc: MFCDef, kind: str, interval_kind: str, step: int, start: float, metrics: Mapping[str, Any]
    ) -> None:
        """Keep a :class:`CallRecord` of a call or hook that started at ``start`` and ends now."""
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and k != "mfc"}
        self._records.append(
            CallRecord(mfc.name, mfc.model_name, kind, interval_kind, self.rank, step, start, time.time(), numbers)
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_threads(self, threads: int) -> None:
        """Torch threads of this CPU worker from its next call on (a run calibrating a plan of one
        worker times its calls on one thread and on every core, ``placement.calibrate: run``)."""
        if threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_profiler(self, profiler: CallProfiler) -> None:
        """Run ``profiler.calls`` at ``profiler.steps`` under ``torch.profiler`` (``trainer.profile_calls``)."""
        self._profiler = profiler

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pop_metrics(self) -> list[CallRecord]:
        """This rank's records since the last pop, one per call or hook it ran, in run order; forgets them."""
        records, self._records = self._records, []
        return records

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def copy_weights(self, target: str, source: str) -> list[str]:
        """``target`` starts from ``source``'s current weights (``init: copy`` models at RL start).

        Home to home through the reallocation manager (no files): parameters both models have
        are copied, the target keeps the rest (a critic's value head), and a trainable target
        gets a fresh optimizer. From now on the target's weights are run state: checkpoints
        hold them. All ranks (ONE_TO_ALL) at a quiet point; collective over both home layouts.

        Returns:
            The target's parameters left as they were (empty on ranks outside both homes).
        """
        kept = self._residency().copy_weights(target, source)
        self._copied.add(target)
        return list(kept)

    # ------------------------------------------------------------------ calls
    @register(dispatch_mode=Dispatch.MESH_PROTO, blocking=False)
    def generate(
        self,
        mfc_name: str,
        prompts: DataProto,
        greedy: bool = False,
        evaluate: bool = False,
        *,
        step: int,
        hooks: bool = False,
        partial_tokens: int | None = None,
        resume: bool = False,
    ) -> DataProto | None:
        """Rollout rows for ``prompts`` (see :mod:`rlflow.workers.interfaces.actor`).

        Args:
            mfc_name: a ``generate`` MFC.
            prompts: ``prompts`` / ``prompt_mask`` ``(B, P)`` and non-tensor columns.
            greedy: greedy decoding; without ``evaluate`` one greedy response per prompt,
                repeated ``sampling.n`` times (ReMax's baseline rows).
            evaluate: use the evaluation sampling parameters (held-out prompts).
            step: the training step the driver issued the call for (its :class:`CallRecord`'s).
            hooks: run the call's pre- and post-hooks around it in this task (the driver then
                issues them apart only to hook ranks outside the call's mesh): one Ray task per
                call instead of three on its ranks, in the same order.
            partial_tokens: a partial rollout's call (``rollout.partial_tokens``): at most this many
                new tokens per response, each token's weights version recorded (``token_version``).
            resume: with ``partial_tokens``, ``prompts`` are carried rollout rows to continue.
        """
        mfc = self._mfc(mfc_name, "generate")

        greedy = greedy or mfc.greedy  # the graph's greedy calls (ReMax's baseline) decode greedily

        residency = self._residency()

        def run(interface, engine, data, ctx):
            version = residency.weights_version(mfc)
            if partial_tokens is None:
                out = interface.generate(engine, data, ctx, greedy=greedy, evaluate=evaluate)
            else:
                call = PartialCall(partial_tokens, version, resume)
                out = interface.generate(engine, data, ctx, greedy=greedy, evaluate=evaluate, partial=call)
            # Which weights sampled the rows (a partial row: its oldest token's): the train call
            # measures the policy lag against it.
            out.non_tensor_batch[POLICY_VERSION] = row_versions(out, version)
            return out

        return self._call(mfc, (prompts,), run, step, hooks, rows=carried_rows if resume else interface_rows)

    @register(dispatch_mode=Dispatch.MESH_PROTO, blocking=False)
    def inference(self, mfc_name: str, *inputs: DataProto, step: int, hooks: bool = False) -> DataProto | None:
        """Log-probs, values or rewards of the rows (by the model's role); ``step`` and ``hooks`` as for :meth:`generate`."""
        mfc = self._mfc(mfc_name, "inference")
        return self._call(
            mfc, inputs, lambda interface, engine, data, ctx: interface.inference(engine, data, ctx), step, hooks
        )

    @register(dispatch_mode=Dispatch.MESH_PROTO, blocking=False)
    def train_step(
        self, mfc_name: str, *inputs: DataProto, lr: float | None = None, step: int, hooks: bool = False
    ) -> DataProto | None:
        """Optimizer steps of the model on the rows; returns a row-less DataProto of metrics.

        Args:
            lr: run these steps with a separate constant-``lr`` AdamW (the SFT warm-up before
                RL), leaving the model's own optimizer fresh; see :meth:`Residency.optimizer_for`.
            step, hooks: as for :meth:`generate`.
        """
        mfc = self._mfc(mfc_name, "train_step")
        residency = self._residency()

        def run(interface, engine, data, ctx):
            sampled_by = data.non_tensor_batch.get(POLICY_VERSION)
            if sampled_by is not None:
                version = residency.weights_version(mfc)
                data.non_tensor_batch[POLICY_LAG] = version - np.asarray(sampled_by, dtype=np.int64)
            staleness = token_lag_metrics(data, residency.weights_version(mfc))  # partial rollouts' tokens
            with residency.optimizer_for(mfc.model_name, mfc.name, lr):
                metrics = {**interface.train_step(engine, data, ctx), **staleness}
            residency.step_done(mfc.model_name)
            return DataProto(meta_info=metrics)

        return self._call(mfc, inputs, run, step, hooks)

    def _call(
        self, mfc: MFCDef, inputs: tuple[DataProto, ...], run, step: int, hooks: bool, rows=interface_rows
    ) -> DataProto | None:
        """Runs ``run`` on the call's rows (``rows(mfc, inputs)``) between its hooks."""
        if hooks:
            self._hook("pre_call", mfc, self._residency().prepare, step)
        try:
            out = self._run_call(mfc, inputs, run, step, rows)
        except Exception as exc:
            raise call_error(mfc.name, mfc.model_name, "call", self.rank, exc) from exc
        if hooks:
            self._hook("post_call", mfc, self._residency().release, step)
        return out

    def _run_call(self, mfc: MFCDef, inputs: tuple[DataProto, ...], run, step: int, rows) -> DataProto | None:
        layout = self.setup.layouts[mfc.name]
        coords = layout.local_coords(self.rank)
        if coords is None:
            raise RuntimeError(f"rank {self.rank} is not in the layout {layout.ranks} of MFC {mfc.name!r}")
        residency = self._residency()
        ctx = CallContext(mfc, residency.call_groups(layout), step)
        data = rows(mfc, inputs)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        wall_start, start = time.time(), time.perf_counter()
        with self._profiler.profile(mfc.name, step, self.rank, self.device):
            out = run(self.interfaces[mfc.model_name], residency.engine_for(mfc), data, ctx)
        local = {k: float(v) for k, v in (out.meta_info if out is not None else {}).items()}
        local["time_s"] = time.perf_counter() - start
        local["peak_memory_bytes"] = peak_memory_bytes(self.device)
        local["tokens"] = num_tokens(out if mfc.interface_type == "generate" else data)
        rows = len(out) if mfc.interface_type == "generate" else len(data)
        metrics = {"mfc": mfc.name, **reduce_metrics(local, rows, ctx)}
        self._record(mfc, "call", "call", step, wall_start, {**metrics, "time_s": local["time_s"]})
        if coords.tp != 0 or coords.pp != layout.strategy.pp - 1:
            return None
        if mfc.is_train:
            return DataProto(meta_info=metrics)
        result = dataflow_rows(mfc, out, passthrough=mfc.interface_type == "generate")
        result.meta_info.update(metrics)
        return result

    # ------------------------------------------------------------------ checkpoints
    def _stateful_models(self) -> list[str]:
        """Models whose weights change during a run: trainable ones, targets of weight hooks (EMA)
        and models that took another's weights (:meth:`copy_weights`)."""
        targets = {m.model_name for m in self.setup.mfcs.values() if m.hook_sources} | self._copied
        return [name for name, model in self.setup.models.items() if model.trainable or name in targets]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, hf: bool = True) -> None:
        """Write this rank's state into ``path`` (the driver makes the directory's save atomic).

        Trainable models: engine shards (weights, optimizer, scheduler; one file per home rank)
        under ``<model>/engine`` and, with ``hf`` (``checkpoint.save_hf``), an HF export with the
        run's tokenizer and generation config under ``<model>/hf`` (written by the home mesh's
        rank 0). Frozen models whose weights changed (EMA reference, a reference copied from the
        actor at RL start): their full weights as ``<model>/weights.safetensors`` (HF names,
        written by the home mesh's rank 0). Every rank: ``worker_rank<r>.pt`` with its RNG
        states, interface state (rollout counters, KL coefficient) and the names of the
        copied models. Collective over each model's home ranks.
        """
        residency = self._residency()
        for name in self._stateful_models():
            with residency.home_loaded(name) as engine:
                if engine is None:
                    continue
                if self.setup.models[name].trainable:
                    engine.save_checkpoint(os.path.join(path, name, "engine"))
                    if hf:
                        self._export_hf(engine, os.path.join(path, name, "hf"))
                else:
                    _save_weights(engine, os.path.join(path, name, FROZEN_WEIGHTS))
        state = {
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": _numpy_rng_state(),
            "interfaces": {name: iface.state_dict() for name, iface in self.interfaces.items()},
            "copied": sorted(self._copied),
            # Weight versions go on counting after a resume: the policy lag of rollouts saved with
            # the checkpoint (algorithm.policy_lag) is measured against them.
            "versions": {name: residency.manager.version(name) for name in self._stateful_models()},
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        os.makedirs(path, exist_ok=True)
        torch.save(state, os.path.join(path, f"worker_rank{self.rank:05d}.pt"))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore :meth:`save_checkpoint` written under the same setup; copies re-synchronise on their next call."""
        residency = self._residency()
        state = torch.load(os.path.join(path, f"worker_rank{self.rank:05d}.pt"), weights_only=True)
        self._copied = set(state.get("copied", []))  # their weights are in the checkpoint, not the model dirs
        for name in self._stateful_models():
            with residency.home_loaded(name) as engine:
                if engine is None:
                    continue
                if self.setup.models[name].trainable:
                    engine.load_checkpoint(os.path.join(path, name, "engine"))
                else:
                    engine.load_state_dict_full(load_file(os.path.join(path, name, FROZEN_WEIGHTS)))
                if name in state.get("versions", {}):
                    residency.manager.restore_version(name, int(state["versions"][name]))
                else:  # a checkpoint without versions: a new one, so copies made before the restore are stale
                    residency.step_done(name)
        torch.set_rng_state(state["torch_rng"])
        _set_numpy_rng_state(state["numpy_rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        for name, iface_state in state["interfaces"].items():
            self.interfaces[name].load_state_dict(iface_state)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_pretrained(self, model_name: str, path: str) -> None:
        """Export ``model_name`` as an HF checkpoint with the run's tokenizer and generation config at
        ``path``; collective over its home ranks (rank 0 writes)."""
        residency = self._residency()
        if model_name not in residency.models or residency.models[model_name].home is None:
            raise KeyError(
                f"model {model_name!r} has no weights to export; models with weights: "
                f"{sorted(n for n, h in residency.models.items() if h.home is not None)}"
            )
        with residency.home_loaded(model_name) as engine:
            if engine is not None:
                self._export_hf(engine, path)

    def _export_hf(self, engine: TrainEngine, path: str) -> None:
        """``engine``'s HF export at ``path`` with the run's tokenizer and generation config; collective
        over its mesh, whose rank 0 writes (:func:`rlflow.workers.hf_export.complete_hf_export`)."""
        engine.save_pretrained(path)
        if engine.dp_rank == engine.tp_rank == engine.pp_rank == 0:  # the rank that wrote the weights
            complete_hf_export(path, self.setup.tokenizer_path, self.setup.sampling)


def _numpy_rng_state() -> dict[str, Any]:
    """numpy's global RNG state as tensors and numbers (loadable with ``weights_only=True``)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def _set_numpy_rng_state(state: Mapping[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["name"], keys, state["pos"], state["has_gauss"], state["gauss"]))


def _save_weights(engine: TrainEngine, path: str) -> None:
    """The full weights of ``engine`` as one safetensors file, written by its mesh's rank 0; collective over the mesh.

    Written with safetensors rather than ``save_pretrained``: transformers writes only on global
    rank 0, which need not be in the model's home.
    """
    weights = engine.state_dict_full()
    if weights is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, path)
