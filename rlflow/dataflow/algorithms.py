"""Algorithms as registered records, and the dataflow graphs of the ones rlflow ships.

An :class:`Algorithm` is everything the rest of rlflow reads about an algorithm: its graph
builder, what one training row is (``dataset``), how rows group on a dp rank, the models it
needs and trains, its default advantage estimator and where its KL term goes. Config
validation, the trainer's build steps, placement, data loading and the workers read the
record, never the algorithm's name; each train call declares its objective on its
:class:`~rlflow.dataflow.mfc.MFCDef`. Users add an algorithm with :func:`register_algorithm`.

Dataflow keys (what trainers, workers and the planner's transfer model agree on):

==========================  ==========================================================
key                         meaning (shape, dtype)
==========================  ==========================================================
``prompts``, ``prompt_mask``  dataset: left-padded prompt ids / mask (B, P)
``answers``                 dataset: reference answers for rule-based rewards (B,)
``input_ids``               prompt + response ids (N, P+R), int64
``attention_mask``          (N, P+R), 1 for real tokens
``response_mask``           (N, P+R), 1 for response tokens the policy sampled (the loss mask: a multi-turn
                            row's observation tokens are real in ``attention_mask`` but 0 here)
``old_logp``                log-prob of every token under the policy the PPO ratio is taken against
                            (N, P+R), float: the rollout's own, or recomputed by the trainer
``rollout_logp``            with ``GraphOptions.recompute_old_logp``: the rollout engine's log-probs
``token_version``           with ``GraphOptions.token_versions`` (partial rollouts): the weights version that
                            sampled each response token (N, P+R), int64, 0 elsewhere
``ref_logp``                the same under the reference model
``teacher_logp``            the same under the distillation teacher (:func:`with_teacher`)
``teacher_vocab_logp``      with ``GraphOptions.teacher_vocab``: the teacher's log-probs of the whole vocabulary at
                            every position (N, P+R, V), float; position t holds the distribution of token t
``values``                  critic values (N, P+R), float
``rewards``                 one scalar per sequence (N,), float
``env_rewards``             multi-turn rollouts: each episode's summed step rewards (N,), a non-tensor column
                            the reward call adds to its score
``greedy_*``                ReMax: the same keys for the greedy (baseline) rollout
``loss_mask``               SFT / DPO / RM datasets: 1 for tokens that enter the loss
==========================  ==========================================================

DPO and RM datasets interleave pairs along the batch: row ``2i`` chosen, ``2i+1`` rejected.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Literal

import networkx as nx

from rlflow.dataflow.graph import build_graph
from rlflow.dataflow.mfc import MFCDef, ParamReallocHook

__all__ = [
    "DATASETS",
    "RECOMPUTE_CALL_SUFFIX",
    "Algorithm",
    "GraphOptions",
    "algorithm_graph",
    "algorithm_mfcs",
    "get_algorithm",
    "list_algorithms",
    "register_algorithm",
    "with_old_logp_recompute",
    "with_token_versions",
    "with_teacher",
]

ROLLOUT_KEYS = ("input_ids", "attention_mask", "response_mask")
GEN_OUTPUT_KEYS = ROLLOUT_KEYS + ("old_logp",)
PROMPT_KEYS = ("prompts", "prompt_mask")
TOKEN_VERSION = "token_version"
PAIR_KEYS = ("input_ids", "attention_mask", "loss_mask")
# What one training row is: a prompt to sample from, a (chosen, rejected) pair, a prompt+response example.
DATASETS = ("prompts", "pairs", "examples")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

# The old-log-prob recompute call of model X is named X + this (``actor_inf``).
RECOMPUTE_CALL_SUFFIX = "_inf"
# On-policy distillation: the frozen teacher's model name and its log-prob call.
TEACHER, TEACHER_CALL = "teacher", "teacher_inf"

# OpenRLHF's default EMA coefficient (--ema_beta 0.992) expressed as a blend factor 1 - beta. The
# one default of the EMA factor: the trainer's ``algorithm.ema_eta`` reads it from here.
DEFAULT_REF_EMA_ETA = 0.008


# --- What a graph depends on ---


@dataclass(frozen=True)
class GraphOptions:
    """The settings an algorithm's graph depends on.

    Args:
        n_seqs: sequences per call; ``None``: decided by the workload.
        n_mbs: micro-batches per call; ``None``: the planner picks.
        n_ppo_minibatches: optimizer steps per RL train call; ``None``: the workload's default.
        rule_based_reward: rewards come from a rule on the host rather than a reward model;
            ``None``: the algorithm's default (:attr:`Algorithm.reward_by_rule`).
        use_ref: keep the reference call (a KL term reads it); algorithms whose record says
            ``ref="always"`` build it regardless.
        ref_ema_eta: PPO-EMA blend factor of the actor into the reference per iteration.
        recompute_old_logp: recompute the behaviour log-probs with the trainer's model and engine
            in an inference call after the rollout (:func:`with_old_logp_recompute`); only for
            algorithms that sample responses.
        token_versions: the rollout records each token's weights version and the policy's train
            calls read it (partial rollouts, :func:`with_token_versions`).
        use_teacher: add the distillation teacher's log-prob call (:func:`with_teacher`); algorithms
            whose record ``needs_teacher`` build it regardless; only for algorithms that sample responses.
        teacher_vocab: the teacher's call also writes its whole next-token distributions,
            ``teacher_vocab_logp`` (``algorithm.distill_loss: full_vocab``); only with ``use_teacher``.
    """

    n_seqs: int | None = None
    n_mbs: int | None = None
    n_ppo_minibatches: int | None = None
    rule_based_reward: bool | None = None
    use_ref: bool = True
    ref_ema_eta: float = DEFAULT_REF_EMA_ETA
    recompute_old_logp: bool = False
    token_versions: bool = False
    use_teacher: bool = False
    teacher_vocab: bool = False


# --- The record ---


@dataclass(frozen=True)
class Algorithm:
    """One algorithm: its graph and the rules the config, trainer, placement, data and workers read.

    Args:
        name: the ``algorithm.name`` of a config (lower-case letters, digits, ``_``).
        build_mfcs: the graph builder, :class:`GraphOptions` -> the MFCs of one iteration; every
            ``train_step`` declares its ``objective``.
        dataset: what one training row is (``DATASETS``): ``"prompts"`` to sample responses
            from (RL), ``"pairs"`` of (chosen, rejected) answers, or ``"examples"`` of prompt +
            response.
        default_estimator: the advantage estimator when ``algorithm.adv_estimator`` is null;
            set for (and only for) algorithms that sample responses.
        ref: when the reference model is used: ``"never"``, ``"kl"`` (when ``kl_coef > 0``) or
            ``"always"`` (DPO's implicit reward, PPO-EMA's moving anchor).
        trains: the models its train calls optimise besides a critic (a critic is needed, and
            trained, exactly when the estimator reads values).
        groups_samples: a prompt's samples must share a dp rank whatever the estimator (ReMax:
            its greedy baseline is per prompt).
        reward_by_rule: rewards come from a rule unless a reward model is configured (the
            graph's default when :attr:`GraphOptions.rule_based_reward` is ``None``).
        kl_in_reward: where the KL term goes by default: subtracted from the token rewards
            (True), or a loss term of the policy (False).
        scores_responses: its graph scores the sampled responses (a reward call); False: the
            advantage reads no reward (on-policy distillation).
        needs_teacher: its graph always has the distillation teacher's call (:func:`with_teacher`).
        description: one line for listings.
    """

    name: str
    build_mfcs: Callable[[GraphOptions], list[MFCDef]]
    dataset: Literal["prompts", "pairs", "examples"]
    default_estimator: str | None = None
    ref: Literal["never", "kl", "always"] = "never"
    trains: tuple[str, ...] = ("actor",)
    groups_samples: bool = False
    reward_by_rule: bool = False
    kl_in_reward: bool = False
    scores_responses: bool = True
    needs_teacher: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        where = f"algorithm {self.name!r}"
        if not _NAME.match(self.name):
            raise ValueError(f"{where}: the name must be lower-case letters, digits and '_'")
        if self.dataset not in DATASETS:
            raise ValueError(f"{where}: dataset={self.dataset!r}, expected one of {DATASETS}")
        if self.ref not in ("never", "kl", "always"):
            raise ValueError(f"{where}: ref={self.ref!r}, expected 'never', 'kl' or 'always'")
        if self.samples_responses != (self.default_estimator is not None):
            raise ValueError(
                f"{where}: default_estimator={self.default_estimator!r}; an algorithm that samples responses "
                "(dataset 'prompts') needs one, and only such an algorithm has one"
            )
        if self.groups_samples and not self.samples_responses:
            raise ValueError(f"{where}: groups_samples needs sampled responses (dataset 'prompts')")
        if not self.trains:
            raise ValueError(f"{where}: trains names no model")
        if (self.needs_teacher or not self.scores_responses) and not self.samples_responses:
            raise ValueError(f"{where}: needs_teacher and scores_responses=False need sampled responses")

    @property
    def samples_responses(self) -> bool:
        """RL: a rollout samples responses to prompts and a reward scores them."""
        return self.dataset == "prompts"

    def uses_ref(self, kl_coef: float) -> bool:
        """Whether the reference model is built, given the KL weight."""
        return self.ref == "always" or (self.ref == "kl" and kl_coef > 0)

    def row_group_size(self, n_samples: int, group_relative: bool) -> int:
        """Rows that must share a dp rank: a (chosen, rejected) pair; a prompt's ``n_samples``
        samples when the estimator compares them (``group_relative``) or the algorithm needs it.

        >>> get_algorithm("dpo").row_group_size(8, False), get_algorithm("grpo").row_group_size(8, True)
        (2, 8)
        """
        if self.dataset == "pairs":
            return 2
        if self.samples_responses and (group_relative or self.groups_samples):
            return n_samples
        return 1

    def required_models(
        self, *, kl_coef: float, critic: bool, reward_model: bool, teacher: bool = False
    ) -> tuple[str, ...]:
        """The models a run builds, in ``("actor", "ref", "critic", "reward")`` order, then the others sorted.

        Args:
            kl_coef: the KL weight (a reference is built for it under ``ref="kl"``).
            critic: the estimator reads values (GAE).
            reward_model: a configured reward model scores responses (no rule-based reward).
            teacher: the advantage reads a distillation teacher (built anyway under ``needs_teacher``).

        >>> get_algorithm("ppo").required_models(kl_coef=0.1, critic=True, reward_model=False)
        ('actor', 'ref', 'critic')
        """
        needed = set(self.trains)
        if self.uses_ref(kl_coef):
            needed.add("ref")
        if critic and self.samples_responses:
            needed.add("critic")
        if reward_model and self.samples_responses and self.scores_responses:
            needed.add("reward")
        if (teacher and self.samples_responses) or self.needs_teacher:
            needed.add(TEACHER)
        return tuple(r for r in ("actor", "ref", "critic", "reward") if r in needed) + tuple(
            sorted(needed - {"actor", "ref", "critic", "reward"})
        )

    def graph(self, options: GraphOptions | None = None) -> nx.DiGraph:
        """The validated dataflow graph under ``options`` (defaults: :class:`GraphOptions`)."""
        options = options or GraphOptions()
        if options.rule_based_reward is None:
            options = replace(options, rule_based_reward=self.reward_by_rule)
        if self.ref == "always" and not options.use_ref:
            options = replace(options, use_ref=True)
        if self.needs_teacher and not options.use_teacher:
            options = replace(options, use_teacher=True)
        mfcs = self.build_mfcs(options)
        if options.use_teacher:
            if not self.samples_responses:
                raise ValueError(f"algorithm {self.name!r} samples nothing: a teacher has no samples to score")
            mfcs = with_teacher(mfcs, vocab=options.teacher_vocab)
        elif options.teacher_vocab:
            raise ValueError(f"algorithm {self.name!r}: teacher_vocab=True needs the teacher's call (use_teacher)")
        if options.recompute_old_logp:
            if not self.samples_responses:
                raise ValueError(f"algorithm {self.name!r} samples nothing: it has no old log-probs to recompute")
            mfcs = with_old_logp_recompute(mfcs)
        if options.token_versions:
            mfcs = with_token_versions(mfcs)
        graph = build_graph(mfcs)
        graph.graph["algorithm"] = self.name
        return graph


# --- Registry ---

_ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algo: Algorithm) -> Algorithm:
    """Add ``algo`` to the registry; returns it.

    Raises:
        ValueError: an algorithm of that name is already registered.
    """
    if algo.name in _ALGORITHMS:
        raise ValueError(f"algorithm {algo.name!r} is already registered")
    _ALGORITHMS[algo.name] = algo
    return algo


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm ``name``.

    Raises:
        ValueError: no such algorithm; the message lists the registered ones.
    """
    if name not in _ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {list_algorithms()}")
    return _ALGORITHMS[name]


def list_algorithms() -> list[str]:
    """Names of the registered algorithms, sorted."""
    return sorted(_ALGORITHMS)


def algorithm_mfcs(name: str, **options) -> list[MFCDef]:
    """The MFCs of a registered algorithm; ``options`` are :class:`GraphOptions` fields.

    >>> [m.name for m in algorithm_mfcs("grpo")]
    ['actor_gen', 'ref_inf', 'reward_inf', 'actor_train']
    """
    return [data["mfc"] for _, data in algorithm_graph(name, **options).nodes(data=True)]


def algorithm_graph(name: str, **options) -> nx.DiGraph:
    """The validated dataflow graph of a registered algorithm; ``options`` are :class:`GraphOptions` fields.

    Raises:
        ValueError: an unknown algorithm or option.
    """
    algo = get_algorithm(name)
    known = {f.name for f in fields(GraphOptions)}
    unknown = set(options) - known
    if unknown:
        raise ValueError(
            f"unknown option(s) {sorted(unknown)} for algorithm {name!r}; expected a subset of {sorted(known)}"
        )
    return algo.graph(GraphOptions(**options))


# --- The old-log-prob recompute ---


def with_old_logp_recompute(mfcs: list[MFCDef]) -> list[MFCDef]:
    """The MFCs with the behaviour log-probs recomputed by the trainer after the rollout.

    The generate call that writes ``old_logp`` writes it as ``rollout_logp`` instead; an
    inference call on its model (``<model>_inf``, placed right after it) reads the rollout and
    writes ``old_logp`` with the training engine's forward, so every reader of ``old_logp`` (the
    PPO ratio, a KL in the reward) gets the trainer's numerics. The ``rl`` train calls of that
    model also read ``rollout_logp``, for the truncated importance weight against the rollout and
    the decoupled correction of ``policy_lag``. The recompute call reads ``rollout_logp`` too: it
    logs the mismatch between the two.

    Raises:
        ValueError: not exactly one generate call writes ``old_logp``, it does not write the
            rollout keys under their own names, or a call named ``<model>_inf`` already exists.

    >>> [m.name for m in with_old_logp_recompute(algorithm_mfcs("grpo"))]
    ['actor_gen', 'actor_inf', 'ref_inf', 'reward_inf', 'actor_train']
    """
    gens = [m for m in mfcs if m.interface_type == "generate" and "old_logp" in m.output_keys]
    if len(gens) != 1:
        raise ValueError(f"recomputing old_logp needs one generate call writing it; got {[m.name for m in gens]}")
    (gen,) = gens
    if not set(ROLLOUT_KEYS) <= set(gen.output_keys):
        raise ValueError(f"MFC {gen.name!r} must write {ROLLOUT_KEYS} for old_logp to be recomputed from them")
    name = gen.model_name + RECOMPUTE_CALL_SUFFIX
    if any(m.name == name for m in mfcs):
        raise ValueError(f"the graph already has a call named {name!r}; the old-log-prob recompute takes that name")
    returned = next(iface for iface, key in gen.interface_outputs().items() if key == "old_logp")
    rollout = replace(
        gen,
        output_keys=tuple("rollout_logp" if k == "old_logp" else k for k in gen.output_keys),
        output_key_remap={**gen.output_key_remap, returned: "rollout_logp"},
    )
    recompute = MFCDef(
        name,
        gen.model_name,
        "inference",
        ROLLOUT_KEYS + ("rollout_logp",),
        ("old_logp",),
        output_key_remap={"logp": "old_logp"},
        n_seqs=gen.n_seqs,
        n_mbs=gen.n_mbs,
    )
    out: list[MFCDef] = []
    for mfc in mfcs:
        if mfc is gen:
            out += [rollout, recompute]
        elif mfc.objective == "rl" and mfc.model_name == gen.model_name:
            out.append(replace(mfc, input_keys=mfc.input_keys + ("rollout_logp",)))
        else:
            out.append(mfc)
    return out


def with_token_versions(mfcs: list[MFCDef]) -> list[MFCDef]:
    """The MFCs with ``token_version`` written by the sampling generate call and read by the ``rl``
    train calls of its model (partial rollouts: the train call logs the tokens' staleness).

    Raises:
        ValueError: not exactly one sampling (not greedy) generate call.

    >>> [m.output_keys[-1] for m in with_token_versions(algorithm_mfcs("grpo")) if m.name == "actor_gen"]
    ['token_version']
    """
    gens = [m for m in mfcs if m.interface_type == "generate" and not m.greedy]
    if len(gens) != 1:
        raise ValueError(f"token versions need one sampling generate call; got {[m.name for m in gens]}")
    (gen,) = gens
    out: list[MFCDef] = []
    for mfc in mfcs:
        if mfc is gen:
            mfc = replace(mfc, output_keys=mfc.output_keys + (TOKEN_VERSION,))
        elif mfc.objective == "rl" and mfc.model_name == gen.model_name:
            mfc = replace(mfc, input_keys=mfc.input_keys + (TOKEN_VERSION,))
        out.append(mfc)
    return out


# --- The distillation teacher ---


def with_teacher(mfcs: list[MFCDef], vocab: bool = False) -> list[MFCDef]:
    """The MFCs with a frozen teacher's log-probs of the sampled responses, for on-policy distillation.

    An inference call ``teacher_inf`` on model ``teacher`` (placed right after the generate call
    that writes ``old_logp``, the shape of the reference's ``ref_inf``) reads the rollout and writes
    ``teacher_logp``; the ``rl`` train calls of the generating model read it for their advantages.
    ``vocab``: it also writes ``teacher_vocab_logp``, its whole next-token distributions, which the
    train calls read for the full-vocabulary KL loss.

    Raises:
        ValueError: not exactly one generate call writes ``old_logp``, or a call named
            ``teacher_inf`` already exists.

    >>> [m.name for m in with_teacher(algorithm_mfcs("grpo"))]
    ['actor_gen', 'teacher_inf', 'ref_inf', 'reward_inf', 'actor_train']
    """
    gens = [m for m in mfcs if m.interface_type == "generate" and "old_logp" in m.output_keys]
    if len(gens) != 1:
        raise ValueError(
            f"a distillation teacher needs one generate call writing old_logp; got {[m.name for m in gens]}"
        )
    if any(m.name == TEACHER_CALL for m in mfcs):
        raise ValueError(f"the graph already has a call named {TEACHER_CALL!r}")
    (gen,) = gens
    keys = ("teacher_logp", "teacher_vocab_logp") if vocab else ("teacher_logp",)
    teacher = MFCDef(
        TEACHER_CALL,
        TEACHER,
        "inference",
        ROLLOUT_KEYS,
        keys,
        output_key_remap={"logp": "teacher_logp", **({"vocab_logp": "teacher_vocab_logp"} if vocab else {})},
        n_seqs=gen.n_seqs,
        n_mbs=gen.n_mbs,
    )
    out: list[MFCDef] = []
    for mfc in mfcs:
        if mfc.objective == "rl" and mfc.model_name == gen.model_name:
            out.append(replace(mfc, input_keys=mfc.input_keys + keys))
        else:
            out.append(mfc)
        if mfc is gen:
            out.append(teacher)
    return out


# --- The graphs of the shipped algorithms ---


def _common(o: GraphOptions) -> dict:
    return {"n_seqs": o.n_seqs, "n_mbs": o.n_mbs}


def _actor_gen(o: GraphOptions) -> MFCDef:
    return MFCDef("actor_gen", "actor", "generate", PROMPT_KEYS, GEN_OUTPUT_KEYS, **_common(o))


def _ref_inf(o: GraphOptions, keys: tuple[str, ...] = ROLLOUT_KEYS, hooks: tuple = ()) -> MFCDef:
    return MFCDef(
        "ref_inf",
        "ref",
        "inference",
        keys,
        ("ref_logp",),
        output_key_remap={"logp": "ref_logp"},
        pre_hooks=hooks,
        **_common(o),
    )


def _reward(o: GraphOptions, name: str = "reward_inf", prefix: str = "") -> MFCDef:
    """A reward call: a reward model's inference, or a rule on the host when ``rule_based_reward``."""
    rule = bool(o.rule_based_reward)
    keys = tuple(prefix + k for k in ROLLOUT_KEYS) + (("answers",) if rule else ())
    return MFCDef(
        name,
        "reward",
        "inference",
        keys,
        (prefix + "rewards",),
        input_key_remap={prefix + k: k for k in ROLLOUT_KEYS} if prefix else {},
        output_key_remap={"rewards": prefix + "rewards"} if prefix else {},
        runs_on_host=rule,
        **_common(o),
    )


def _train(name: str, model: str, keys: tuple[str, ...], o: GraphOptions, objective: str) -> MFCDef:
    # RL train calls take the configured mini-batches; supervised ones one optimizer step per batch.
    n_minibatches = o.n_ppo_minibatches if objective in ("rl", "value") else 1
    return MFCDef(name, model, "train_step", keys, (), n_minibatches=n_minibatches, objective=objective, **_common(o))


def _ref_calls(o: GraphOptions, hooks: tuple = ()) -> tuple[list[MFCDef], tuple[str, ...]]:
    """The reference call and the key it adds to the train calls' inputs, or nothing without ``use_ref``."""
    if not o.use_ref:
        return [], ()
    return [_ref_inf(o, hooks=hooks)], ("ref_logp",)


def ppo_mfcs(o: GraphOptions, ref_hooks: tuple = ()) -> list[MFCDef]:
    """PPO: rollout, critic values, reference log-probs, reward, then actor and critic train steps."""
    ref, ref_keys = _ref_calls(o, ref_hooks)
    train_keys = GEN_OUTPUT_KEYS + ref_keys + ("values", "rewards")
    return [
        _actor_gen(o),
        MFCDef("critic_inf", "critic", "inference", ROLLOUT_KEYS, ("values",), **_common(o)),
        *ref,
        _reward(o),
        _train("actor_train", "actor", train_keys, o, "rl"),
        _train("critic_train", "critic", train_keys, o, "value"),
    ]


def ppo_ema_mfcs(o: GraphOptions) -> list[MFCDef]:
    """PPO whose reference moves toward the actor by ``ref_ema_eta`` before each reference call."""
    return ppo_mfcs(o, ref_hooks=(ParamReallocHook(source="actor", eta=o.ref_ema_eta),))


def critic_free_mfcs(o: GraphOptions) -> list[MFCDef]:
    """GRPO, RLOO, REINFORCE++: rollout, reference, reward, actor train step (no critic)."""
    ref, ref_keys = _ref_calls(o)
    train_keys = GEN_OUTPUT_KEYS + ref_keys + ("rewards",)
    return [_actor_gen(o), *ref, _reward(o), _train("actor_train", "actor", train_keys, o, "rl")]


def remax_mfcs(o: GraphOptions) -> list[MFCDef]:
    """ReMax: a sampled and a greedy rollout, both scored; the greedy reward is the baseline."""
    greedy_out = {k: "greedy_" + k for k in ROLLOUT_KEYS}
    greedy = MFCDef(
        "actor_gen_greedy",
        "actor",
        "generate",
        PROMPT_KEYS,
        tuple(greedy_out.values()),
        output_key_remap=greedy_out,
        greedy=True,
        **_common(o),
    )
    ref, ref_keys = _ref_calls(o)
    train_keys = GEN_OUTPUT_KEYS + ref_keys + ("rewards", "greedy_rewards")
    return [
        _actor_gen(o),
        greedy,
        *ref,
        _reward(o),
        _reward(o, name="reward_inf_greedy", prefix="greedy_"),
        _train("actor_train", "actor", train_keys, o, "rl"),
    ]


def distill_mfcs(o: GraphOptions) -> list[MFCDef]:
    """On-policy distillation: rollout, reference (with a KL term), actor train step; no reward call
    (the record's ``needs_teacher`` adds the teacher's call)."""
    ref, ref_keys = _ref_calls(o)
    return [_actor_gen(o), *ref, _train("actor_train", "actor", GEN_OUTPUT_KEYS + ref_keys, o, "rl")]


def dpo_mfcs(o: GraphOptions) -> list[MFCDef]:
    """DPO: reference log-probs of both answers of each pair, then the actor's DPO step."""
    return [_ref_inf(o, keys=PAIR_KEYS), _train("actor_train", "actor", PAIR_KEYS + ("ref_logp",), o, "dpo")]


def sft_mfcs(o: GraphOptions) -> list[MFCDef]:
    """SFT: one cross-entropy step of the actor on prompt + response examples."""
    return [_train("actor_train", "actor", PAIR_KEYS, o, "sft")]


def rm_mfcs(o: GraphOptions) -> list[MFCDef]:
    """Reward modelling: one Bradley-Terry step of the reward model on (chosen, rejected) pairs."""
    return [_train("reward_train", "reward", PAIR_KEYS[:2], o, "rm")]


for _algo in (
    Algorithm("ppo", ppo_mfcs, "prompts", "gae", ref="kl", description="PPO with a critic (GAE)"),
    Algorithm(
        "ppo_ema", ppo_ema_mfcs, "prompts", "gae", ref="always", description="PPO, reference an EMA of the actor"
    ),
    Algorithm(
        "grpo", critic_free_mfcs, "prompts", "grpo", ref="kl", reward_by_rule=True, description="group-relative PG"
    ),
    Algorithm("rloo", critic_free_mfcs, "prompts", "rloo", ref="kl", description="REINFORCE, leave-one-out baseline"),
    Algorithm(
        "remax", remax_mfcs, "prompts", "remax", ref="kl", groups_samples=True, description="greedy-baseline REINFORCE"
    ),
    # REINFORCE++ (OpenRLHF): no critic; the token-level KL penalty enters the rewards, then the
    # discounted returns are whitened over the whole batch.
    Algorithm(
        "reinforce_pp",
        critic_free_mfcs,
        "prompts",
        "reinforce_plus_plus",
        ref="kl",
        kl_in_reward=True,
        description="REINFORCE++: batch-whitened returns, KL in the reward",
    ),
    # On-policy distillation (GKD, Thinking Machines): the advantage of each sampled token is the
    # teacher's log-prob minus the student's (estimator reverse_kl); no reward enters it.
    Algorithm(
        "distill",
        distill_mfcs,
        "prompts",
        "reverse_kl",
        ref="kl",
        scores_responses=False,
        needs_teacher=True,
        description="on-policy distillation: reverse KL to models.teacher per token",
    ),
    Algorithm("dpo", dpo_mfcs, "pairs", ref="always", description="direct preference optimisation"),
    Algorithm("sft", sft_mfcs, "examples", description="supervised fine-tuning"),
    Algorithm("rm", rm_mfcs, "pairs", trains=("reward",), description="Bradley-Terry reward model"),
):
    register_algorithm(_algo)
