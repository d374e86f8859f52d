"""Runs the dataflow graph of one iteration on the worker group: each MFC on its own view.

The driver issues every model function call (MFC) of an iteration at once, in topological
order, as non-blocking calls. A call's inputs are the :class:`~rlflow.controller.DataFuture`
of the calls that produce its keys, so rows go worker → object store → worker and the
driver only holds handles. Each worker runs the calls it is part of in issue order (one Ray
actor runs one call at a time), which gives the two properties the schedule needs:

* calls on disjoint meshes overlap, and calls sharing a device run one after another in the
  same order on every device — collectives of different calls can never interleave;
* the reallocation pre-hook of a call is issued right before it on the ranks that take part
  (home ∪ call ranks), so it reads the model's weights after every earlier train step.

Because nothing waits on the driver between iterations, :meth:`DataflowRunner.submit` may be
called for iteration t+1 before iteration t has finished; calls of t+1 then overlap calls of t
wherever the parameter-version order allows, as in the ReaLHF paper.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import ray

from rlflow.controller import DataFuture, RayWorkerGroup
from rlflow.dataflow import MFCDef, mfcs_of
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
        outputs: MFC name -> the future of its output rows (collected from tp-rank-0 of the last stage).
        hooks: refs of the pre/post hook calls, checked for errors by :meth:`DataflowRunner.wait`.
    """

    outputs: dict[str, DataFuture] = field(default_factory=dict)
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
            )
            for name, p in self.placements.items()
        }
        self.hook_views = {
            name: group.view([position[r] for r in p.hook_ranks]) for name, p in self.placements.items() if p.hook_ranks
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
    ) -> Submitted:
        """Issues the calls of one iteration (all of the graph, or the listed subset) without waiting.

        Args:
            batch: the dataset rows of the iteration (prompts, or pairs for SFT/DPO/RM).
            mfcs: names of the calls to issue, default all; a call's producers must be among them.
            call_kwargs: extra keyword arguments per call name (e.g. ``{"actor_gen": {"greedy": True}}``).
            step: the training step the calls belong to; every call and hook gets it, and the
                workers' records of them carry it (``ModelWorker.pop_metrics``).

        Returns:
            the futures of every issued call and of its hooks.
        """
        names = self.order if mfcs is None else [n for n in self.order if n in set(mfcs)]
        unknown = set(mfcs or ()) - set(self.order)
        if unknown:
            raise ValueError(f"unknown MFC(s) {sorted(unknown)}; the graph has {self.order}")
        rollout = next((n for n in names if self.placements[n].mfc.interface_type == "generate"), None)
        submitted = Submitted()
        for name in names:
            mfc = self.placements[name].mfc
            args = self._sources(mfc, submitted.outputs, batch, rollout if name != rollout else None)
            hook_view = self.hook_views.get(name)
            if hook_view is not None:
                submitted.hooks.append((hook_view, hook_view.async_execute_all("pre_call", name, step)))
            method = getattr(self.views[name], mfc.interface_type)
            submitted.outputs[name] = method(name, *args, **dict((call_kwargs or {}).get(name, {})), step=step)
            if hook_view is not None:
                submitted.hooks.append((hook_view, hook_view.async_execute_all("post_call", name, step)))
        return submitted

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
            if name in fetch:
                results[name] = future.get()
            else:
                _wait_without_payload(future)
        return results


def _wait_without_payload(future: DataFuture) -> None:
    """Waits for a call and raises its workers' errors, fetching only row counts and replicas' ``None``."""
    parts = set(future.part_index or ())
    future.fetch([ref for i, ref in enumerate(future.refs) if i not in parts])
    if future.num_rows_refs is not None:
        future.part_sizes()
    else:
        ray.wait(future.parts or [], num_returns=len(future.parts or []))
