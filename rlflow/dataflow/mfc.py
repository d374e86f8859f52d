"""Model function calls (MFCs): the nodes of a dataflow graph.

An MFC is one call of one kind on one named model per iteration — ``generate`` (rollout),
``inference`` (a forward pass that returns per-token or per-sequence values) or
``train_step`` (forward, backward and optimizer steps). It reads keys of the iteration's data
(``input_keys``) and writes new ones (``output_keys``); a key written by one MFC and read by
another is a data edge of the graph.

Key names are the *dataflow* names every MFC of the graph agrees on. An interface may call
its arguments differently: ``input_key_remap`` maps a dataflow key to the name the interface
receives, ``output_key_remap`` maps a name the interface returns to the dataflow key it is
stored under. ReMax's greedy rollout, for example, returns ``input_ids`` that the graph stores
as ``greedy_input_ids``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

INTERFACE_TYPES = ("generate", "inference", "train_step")
# What a train_step optimises; each role interface serves some of them (``rlflow.workers.interfaces``):
# the policy-gradient loss on advantages, the critic's value loss, DPO over (chosen, rejected) pairs,
# cross-entropy on examples, the reward model's Bradley-Terry loss over pairs.
OBJECTIVES = ("rl", "value", "dpo", "sft", "rm")
# Objectives whose rows come as (chosen, rejected) pairs, row 2i chosen and 2i+1 rejected.
PAIR_OBJECTIVES = ("dpo", "rm")


@dataclass(frozen=True)
class ParamReallocHook:
    """Blend the weights of the called model toward those of model ``source``.

    Run as a pre-hook, it sets ``w <- (1 - eta) * w + eta * w_source`` on the layout of the call
    before the call runs; ``eta == 1`` copies ``source``. PPO with an EMA reference puts
    ``ParamReallocHook(source="actor", eta=...)`` before the reference inference.

    Args:
        source: name of the model whose weights are read.
        eta: blend factor in ``(0, 1]``.
    """

    source: str
    eta: float = 1.0

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("ParamReallocHook.source must name a model")
        if not 0.0 < self.eta <= 1.0:
            raise ValueError(f"ParamReallocHook.eta={self.eta} must be in (0, 1]")


class KeyMap(dict):
    """An immutable, hashable, picklable ``dict`` of key renames."""

    def _readonly(self, *args, **kwargs):
        raise TypeError("key remaps of an MFCDef are immutable")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self):
        return (KeyMap, (dict(self),))


@dataclass(frozen=True)
class MFCDef:
    """Declaration of one model function call.

    Args:
        name: unique name in the graph, e.g. ``"actor_gen"``.
        model_name: the weights it runs on (``"actor"``, ``"critic"``, ``"ref"``, ``"reward"``);
            MFCs with one model name share weights and a version counter.
        interface_type: ``"generate"``, ``"inference"`` or ``"train_step"``.
        input_keys: dataflow keys the call reads.
        output_keys: dataflow keys the call writes.
        input_key_remap: dataflow key -> name the interface receives.
        output_key_remap: name the interface returns -> dataflow key.
        n_seqs: sequences the call processes per iteration (for ``generate``: sequences it
            returns, prompts × samples). ``None``: the iteration's batch, decided by the
            planner's workload or the trainer's config.
        n_mbs: micro-batches per (mini-)batch on every dp rank; ``None`` lets the planner
            pick (see ``rlflow.planner.space.num_microbatches``).
        n_minibatches: optimizer steps per ``train_step`` call (PPO mini-batches); ``None``:
            the workload's default. Must stay ``None`` or 1 for other interfaces.
        balanced_dp: split the batch along dp by balancing tokens rather than rows.
        min_n_seqs_per_dp: every dp rank needs at least this many sequences.
        model_role: what the model is (``"actor"``, ``"critic"``, …); defaults to ``model_name``.
        runs_on_host: the call needs no model on a device (rule-based rewards); the planner
            leaves it out of device placement.
        pre_hooks / post_hooks: hooks run before / after the call, e.g. :class:`ParamReallocHook`.
        greedy: a ``generate`` call that decodes greedily — one greedy response per prompt,
            repeated for every sample slot (ReMax's baseline rollout).
        objective: what a ``train_step`` optimises, one of ``OBJECTIVES`` (``"rl"``, ``"value"``,
            ``"dpo"``, ``"sft"``, ``"rm"``); required on every ``train_step``, ``None`` elsewhere.
            The model's interface dispatches on it.

    >>> MFCDef("ref_inf", "ref", "inference", input_keys=("input_ids",), output_keys=("ref_logp",)).model_role
    'ref'
    """

    name: str
    model_name: str
    interface_type: str
    input_keys: tuple[str, ...] = ()
    output_keys: tuple[str, ...] = ()
    input_key_remap: Mapping[str, str] = field(default_factory=dict)
    output_key_remap: Mapping[str, str] = field(default_factory=dict)
    n_seqs: int | None = None
    n_mbs: int | None = None
    n_minibatches: int | None = None
    balanced_dp: bool = False
    min_n_seqs_per_dp: int = 1
    model_role: str = ""
    runs_on_host: bool = False
    pre_hooks: tuple[ParamReallocHook, ...] = ()
    post_hooks: tuple[ParamReallocHook, ...] = ()
    greedy: bool = False
    objective: str | None = None

    def __post_init__(self) -> None:
        # Normalise containers so that the definition is immutable and hashable.
        for attr in ("input_keys", "output_keys", "pre_hooks", "post_hooks"):
            object.__setattr__(self, attr, tuple(getattr(self, attr)))
        object.__setattr__(self, "input_key_remap", KeyMap(self.input_key_remap or {}))
        object.__setattr__(self, "output_key_remap", KeyMap(self.output_key_remap or {}))
        if not self.model_role:
            object.__setattr__(self, "model_role", self.model_name)
        self._validate()

    def _validate(self) -> None:
        if not self.name:
            raise ValueError("MFCDef.name must be a non-empty string")
        if not self.model_name:
            raise ValueError(f"MFC {self.name!r}: model_name must be a non-empty string")
        if self.interface_type not in INTERFACE_TYPES:
            raise ValueError(
                f"MFC {self.name!r}: interface_type={self.interface_type!r}, expected one of {INTERFACE_TYPES}"
            )
        for attr in ("input_keys", "output_keys"):
            keys = getattr(self, attr)
            if len(set(keys)) != len(keys):
                raise ValueError(f"MFC {self.name!r}: {attr}={keys} lists a key twice")
        if set(self.input_keys) & set(self.output_keys):
            raise ValueError(
                f"MFC {self.name!r} reads and writes {sorted(set(self.input_keys) & set(self.output_keys))}"
            )
        unknown_in = set(self.input_key_remap) - set(self.input_keys)
        if unknown_in:
            raise ValueError(f"MFC {self.name!r}: input_key_remap renames {sorted(unknown_in)}, not in input_keys")
        unknown_out = set(self.output_key_remap.values()) - set(self.output_keys)
        if unknown_out:
            raise ValueError(f"MFC {self.name!r}: output_key_remap targets {sorted(unknown_out)}, not in output_keys")
        for attr in ("n_seqs", "n_mbs", "n_minibatches"):
            value = getattr(self, attr)
            if value is not None and value < 1:
                raise ValueError(f"MFC {self.name!r}: {attr}={value} must be >= 1")
        if self.n_minibatches not in (None, 1) and self.interface_type != "train_step":
            raise ValueError(f"MFC {self.name!r}: n_minibatches={self.n_minibatches} only applies to train_step calls")
        if self.min_n_seqs_per_dp < 1:
            raise ValueError(f"MFC {self.name!r}: min_n_seqs_per_dp={self.min_n_seqs_per_dp} must be >= 1")
        if self.greedy and self.interface_type != "generate":
            raise ValueError(f"MFC {self.name!r}: greedy=True only applies to generate calls")
        if self.runs_on_host and self.interface_type == "train_step":
            raise ValueError(f"MFC {self.name!r}: a train_step cannot run on the host without a model")
        if self.interface_type == "train_step" and self.objective not in OBJECTIVES:
            raise ValueError(f"MFC {self.name!r}: a train_step needs objective in {OBJECTIVES}; got {self.objective!r}")
        if self.interface_type != "train_step" and self.objective is not None:
            raise ValueError(f"MFC {self.name!r}: objective={self.objective!r} only applies to train_step calls")

    def __hash__(self) -> int:
        return hash((self.name, self.model_name, self.interface_type, self.input_keys, self.output_keys))

    @property
    def is_train(self) -> bool:
        return self.interface_type == "train_step"

    @property
    def hook_sources(self) -> tuple[str, ...]:
        """Models whose weights the hooks of this call read."""
        return tuple(h.source for h in self.pre_hooks + self.post_hooks if isinstance(h, ParamReallocHook))

    def interface_inputs(self) -> dict[str, str]:
        """Dataflow key -> argument name the interface receives."""
        return {k: self.input_key_remap.get(k, k) for k in self.input_keys}

    def interface_outputs(self) -> dict[str, str]:
        """Name the interface returns -> dataflow key it is stored under."""
        inverse = {v: k for k, v in self.output_key_remap.items()}
        return {inverse.get(k, k): k for k in self.output_keys}
