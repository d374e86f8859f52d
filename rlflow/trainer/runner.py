"""Runs the dataflow graph of one iteration on the worker group: each MFC on its own view.

The driver issues every model function call (MFC) of an iteration at once, in topological
order, as non-blocking calls. A call's inputs are the :class:`~rlflow.controller.DataFuture`
of the calls that produce its keys, so rows go worker → object store → worker and the
driver only holds handles. Each worker runs the calls it is part of in issue order (one Ray
actor runs one call at a time), which gives the two properties the schedule needs:

* calls on disjoint meshes overlap, and calls sharing a device run one after another in the
  same order on every device — collectives of different calls can never interleave;
* the reallocation pre-hook of a call runs right before it on the ranks that take part
  (home ∪ call ranks), so it reads the model's weights after every earlier train step: the
  call's own ranks run their hooks inside the call's task (``hooks=True``), the other hook
  ranks get hook tasks issued around it.

Because nothing waits on the driver between iterations, :meth:`DataflowRunner.submit` may be
called for iteration t+1 before iteration t has finished; calls of t+1 then overlap calls of t
wherever the parameter-version order allows, as in the ReaLHF paper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
import ray

from rlflow.controller import DataFuture, RayWorkerGroup, driver_host
from rlflow.dataflow import MFCDef, mfcs_of, rollout_calls
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy


@dataclass(frozen=True)
class CallPlacement:
    """Where one MFC runs.

    Attributes:
        mfc: the call.
        ranks: global worker ranks of its mesh, in call-rank order.
        strategy: ``(dp, tp, pp)`` arrangement of ``ranks``.
        hook_ranks: ranks that take part in the call's pre/post hooks (reallocation, reload,
            EMA); empty when the call needs none.
    """

    mfc: MFCDef
    ranks: tuple[int, ...]
    strategy: ParallelStrategy
    hook_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.strategy.world_size != len(self.ranks):
            raise ValueError(
                f"MFC {self.mfc.name!r}: strategy {self.strategy} needs {self.strategy.world_size} ranks, got {self.ranks}"
            )


@dataclass
class Submitted:
    """The handles of one submitted iteration.

    Attributes:
        outputs: MFC name -> the future of its output rows (collected from tp-rank-0 of the last
            stage), or the rows themselves when a checkpoint brought them back (:meth:`LaggedIssuer.load`).
        hooks: refs of the pre/post hook calls, checked for errors by :meth:`DataflowRunner.wait`.
    """

    outputs: dict[str, DataFuture | DataProto] = field(default_factory=dict)
    hooks: list[tuple[RayWorkerGroup, list[ray.ObjectRef]]] = field(default_factory=list)


class DataflowRunner:
    """Issues the MFCs of a dataflow graph on their views of one colocated worker group.

    Args:
        group: the worker group over the whole resource pool; its worker class serves
            ``generate`` / ``inference`` / ``train_step`` (MESH_PROTO) and ``pre_call`` / ``post_call``.
        graph: the algorithm's dataflow graph (:func:`rlflow.dataflow.build_graph`).
        placements: MFC name -> where it runs; every MFC of the graph needs one.
        row_group_size: rows that must stay on one dp rank together (GRPO/RLOO groups of
            samples of one prompt); the dp split of every call respects it.
    """

    def __init__(
        self,
        group: RayWorkerGroup,
        graph: nx.DiGraph,
        placements: Mapping[str, CallPlacement],
        row_group_size: int = 1,
    ) -> None:
        missing = [m.name for m in mfcs_of(graph) if m.name not in placements]
        if missing:
            raise ValueError(f"no placement for MFC(s) {missing}; placements cover {sorted(placements)}")
        self.graph, self.placements = graph, dict(placements)
        self.order = [m.name for m in mfcs_of(graph)]
        position = {rank: i for i, rank in enumerate(group.ranks)}
        # Groups of samples exist only after a rollout: a generate call splits prompts.
        self.views = {
            name: group.view(
                [position[r] for r in p.ranks],
                p.strategy,
                row_group_size=1 if p.mfc.interface_type == "generate" else row_group_size,
                balance_by="attention_mask" if p.mfc.balanced_dp else None,  # tokens per dp rank
            )
            for name, p in self.placements.items()
        }
        # A call runs its own hooks on its ranks (``hooks=True``); the hook ranks outside its mesh
        # (a home that sends the weights) get them as tasks of their own, issued around the call.
        self.folded = {name for name, p in self.placements.items() if p.hook_ranks}
        self.hook_views = {
            name: group.view([position[r] for r in p.hook_ranks if r not in set(p.ranks)])
            for name, p in self.placements.items()
            if set(p.hook_ranks) - set(p.ranks)
        }

    def _sources(self, mfc: MFCDef, issued: Mapping[str, DataFuture], batch: DataProto, rows_from: str | None) -> list:
        """The call's row arguments: the futures of its producers, then the dataset batch if needed.

        A key comes from the call of this submission that produces it; dataset keys of a call
        downstream of a rollout come with the rollout's rows (the sampler repeats non-tensor
        columns such as answers for every sample); the rest from the batch.
        """
        produced = {key: name for name in issued for key in self.placements[name].mfc.output_keys}
        producers: list[str] = []
        from_batch = []
        for key in mfc.input_keys:
            source = produced.get(key)
            if source is None and rows_from is not None and mfc.interface_type != "generate":
                source = rows_from
            if source is None:
                from_batch.append(key)
            elif source not in producers:
                producers.append(source)
        args: list[Any] = [issued[p] for p in producers]
        if from_batch:
            missing = [k for k in from_batch if k not in batch.keys]
            if missing:
                raise KeyError(f"MFC {mfc.name!r} needs dataset key(s) {missing}; the batch has {batch.keys}")
            args.insert(0, batch)
        return args

    def submit(
        self,
        batch: DataProto,
        mfcs: Sequence[str] | None = None,
        call_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        step: int,
        upstream: Submitted | None = None,
    ) -> Submitted:
        """Issues the calls of one iteration (all of the graph, or the listed subset) without waiting.

        Args:
            batch: the dataset rows of the iteration (prompts, or pairs for SFT/DPO/RM).
            mfcs: names of the calls to issue, default all; a call's producers must be among them.
            call_kwargs: extra keyword arguments per call name (e.g. ``{"actor_gen": {"greedy": True}}``).
            step: the training step the calls belong to; every call and hook gets it, and the
                workers' records of them carry it (``ModelWorker.pop_metrics``).
            upstream: calls of the same iteration issued earlier (its rollout, issued ahead when
                rollouts may lag: :meth:`rollout_calls`); their outputs feed these calls, and
                the returned submission includes them, so :meth:`wait` waits for the whole iteration.

        Returns:
            the futures of every issued call and of its hooks.
        """
        names = self.order if mfcs is None else [n for n in self.order if n in set(mfcs)]
        unknown = set(mfcs or ()) - set(self.order)
        if unknown:
            raise ValueError(f"unknown MFC(s) {sorted(unknown)}; the graph has {self.order}")
        submitted = Submitted() if upstream is None else Submitted(dict(upstream.outputs), list(upstream.hooks))
        issued = [*submitted.outputs, *names]
        rollout = next((n for n in issued if self.placements[n].mfc.interface_type == "generate"), None)
        for name in names:
            mfc = self.placements[name].mfc
            args = self._sources(mfc, submitted.outputs, batch, rollout if name != rollout else None)
            hook_view = self.hook_views.get(name)
            if hook_view is not None:
                submitted.hooks.append((hook_view, hook_view.async_execute_all("pre_call", name, step)))
            method = getattr(self.views[name], mfc.interface_type)
            kwargs = {**(call_kwargs or {}).get(name, {}), "step": step, "hooks": name in self.folded}
            submitted.outputs[name] = method(name, *args, **kwargs)
            if hook_view is not None:
                submitted.hooks.append((hook_view, hook_view.async_execute_all("post_call", name, step)))
        return submitted

    def rollout_calls(self) -> list[str]:
        """The calls an iteration may issue ahead of the train steps of earlier iterations
        (:func:`rlflow.dataflow.rollout_calls`), in issue order."""
        return rollout_calls(self.graph)

    def wait(self, submitted: Submitted, fetch: Sequence[str] = ()) -> dict[str, DataProto]:
        """Waits for every call of a submission; returns the collected outputs of the ``fetch`` calls.

        Errors of any call or hook surface here as a :class:`~rlflow.controller.WorkerError`
        whose message starts with the call, its model and the rank (``reward_inf (model reward)
        on rank 1: ValueError: ...``), followed by the worker's traceback. Calls are checked
        in issue order, so a failing call is reported before the calls that needed its rows.
        Only the calls named in ``fetch`` bring their rows to the driver.
        """
        for view, refs in submitted.hooks:
            view.get(refs)
        results = {}
        for name, future in submitted.outputs.items():
            if isinstance(future, DataProto):  # rows restored from a checkpoint (LaggedIssuer.load)
                if name in fetch:
                    results[name] = future
            elif name in fetch:
                results[name] = future.get()
            else:
                _wait_without_payload(future)
        return results


class LaggedIssuer:
    """Issues the iterations of a run, each one's rollout up to ``lag`` steps ahead of its training.

    Iteration ``t``'s rollout calls (:meth:`DataflowRunner.rollout_calls`) are issued before the
    train calls of iteration ``t - lag``, so on every worker they come first in issue order: the
    weights they read (through their reallocation pre-hooks) are those after step ``t - 1 - lag``
    and, on a mesh of their own, they run while step ``t - lag`` trains. ``lag = 0`` issues each
    iteration's calls in the order :meth:`DataflowRunner.submit` issues a whole iteration, so the
    run is the synchronous one, call for call.

    Args:
        runner: the runner of the algorithm's graph.
        lag: ``algorithm.policy_lag``.
        last_step: no rollout is issued for a later step.
        sample: with ``lag = 0``, what runs a step's rollout instead of one submission of the
            rollout calls: ``sample(step, batches) -> (batch, rollout rows)`` (dynamic sampling,
            :class:`rlflow.trainer.dynamic_sampling.DynamicSampler`).
    """

    def __init__(
        self,
        runner: DataflowRunner,
        lag: int,
        last_step: int,
        sample: Callable[[int, Iterator[DataProto]], tuple[DataProto, Submitted]] | None = None,
    ) -> None:
        if lag < 0:
            raise ValueError(f"policy_lag={lag} must be >= 0")
        if sample is not None and lag:
            raise ValueError(f"a rollout sampler needs on-policy rollouts, not policy_lag={lag}")
        self.runner, self.lag, self.last_step, self.sample = runner, lag, last_step, sample
        self.rollouts = runner.rollout_calls()
        self.rest = [n for n in runner.order if n not in set(self.rollouts)]
        # Step -> (its dataset batch, its issued rollout), for steps whose other calls are not issued yet.
        self.ahead: dict[int, tuple[DataProto, Submitted]] = {}

    def issue(self, step: int, batches: Iterator[DataProto]) -> Submitted:
        """Issues what step ``step`` needs now: the rollouts of steps up to ``step + lag`` not yet
        issued (drawing their batches from ``batches``), then ``step``'s other calls."""
        if not self.rollouts:
            return self.runner.submit(next(batches), step=step)
        if self.sample is not None:
            batch, rollout = self.sample(step, batches)
            return self.runner.submit(batch, self.rest, step=step, upstream=rollout)
        for ahead in range(step, min(step + self.lag, self.last_step) + 1):
            if ahead not in self.ahead:
                batch = next(batches)
                self.ahead[ahead] = (batch, self.runner.submit(batch, self.rollouts, step=ahead))
        batch, rollout = self.ahead.pop(step)
        return self.runner.submit(batch, self.rest, step=step, upstream=rollout)

    def save(self, directory: Path) -> list[int]:
        """Write the rollouts issued ahead (their batch and every call's rows) under ``directory``,
        waiting for them; returns their steps. A checkpoint holds them so that a resumed run
        trains on the rows the interrupted one sampled, with the same lag."""
        for step, (batch, rollout) in sorted(self.ahead.items()):
            folder = directory / f"step_{step}"
            folder.mkdir(parents=True)
            batch.save(folder / "batch.safetensors")
            for name, future in rollout.outputs.items():
                rows = future if isinstance(future, DataProto) else future.get()
                rows.save(folder / f"{name}.safetensors")
        return sorted(self.ahead)

    def load(self, directory: Path, steps: Sequence[int]) -> None:
        """Take back the rollouts :meth:`save` wrote for ``steps``: their rows feed those steps' calls."""
        for step in steps:
            folder = directory / f"step_{step}"
            outputs = {name: DataProto.load(folder / f"{name}.safetensors") for name in self.rollouts}
            self.ahead[step] = (DataProto.load(folder / "batch.safetensors"), Submitted(outputs))

    def drain(self) -> None:
        """Waits for the rollouts issued ahead (a run stopping early), raising their errors; keeps
        them, so a final checkpoint saves them for a run that resumes to train further."""
        for _, rollout in self.ahead.values():
            self.runner.wait(rollout)


def _wait_without_payload(future: DataFuture) -> None:
    """Waits for a call and raises its workers' errors, fetching only row counts and replicas' ``None``."""
    parts = set(future.part_index or ())
    future.fetch([ref for i, ref in enumerate(future.refs) if i not in parts])
    if future.num_rows_refs is not None:
        future.part_sizes()
    else:
        driver_host.wait(future.parts or [])  # Ray's refs or a driver-hosted worker's
