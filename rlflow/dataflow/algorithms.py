"""The dataflow graphs of the algorithms rlflow ships.

Dataflow keys (what trainers, workers and the planner's transfer model agree on):

==========================  ==========================================================
key                         meaning (shape, dtype)
==========================  ==========================================================
``prompts``, ``prompt_mask``  dataset: left-padded prompt ids / mask (B, P)
``answers``                 dataset: reference answers for rule-based rewards (B,)
``input_ids``               prompt + response ids (N, P+R), int64
``attention_mask``          (N, P+R), 1 for real tokens
``response_mask``           (N, P+R), 1 for response tokens
``old_logp``                log-prob of every token under the rollout policy (N, P+R), float
``ref_logp``                the same under the reference model
``values``                  critic values (N, P+R), float
``rewards``                 one scalar per sequence (N,), float
``greedy_*``                ReMax: the same keys for the greedy (baseline) rollout
``loss_mask``               SFT / DPO / RM datasets: 1 for tokens that enter the loss
==========================  ==========================================================

DPO and RM datasets interleave pairs along the batch: row ``2i`` chosen, ``2i+1`` rejected.
"""

from __future__ import annotations

import networkx as nx

from rlflow.dataflow.graph import build_graph
from rlflow.dataflow.mfc import MFCDef, ParamReallocHook

ROLLOUT_KEYS = ("input_ids", "attention_mask", "response_mask")
GEN_OUTPUT_KEYS = ROLLOUT_KEYS + ("old_logp",)
PROMPT_KEYS = ("prompts", "prompt_mask")
PAIR_KEYS = ("input_ids", "attention_mask", "loss_mask")

# OpenRLHF's default EMA coefficient (--ema_beta 0.992) expressed as a blend factor 1 - beta.
DEFAULT_REF_EMA_ETA = 0.008


def _common(kw: dict) -> dict:
    return {"n_seqs": kw.get("n_seqs"), "n_mbs": kw.get("n_mbs")}


def _actor_gen(kw: dict) -> MFCDef:
    return MFCDef("actor_gen", "actor", "generate", PROMPT_KEYS, GEN_OUTPUT_KEYS, **_common(kw))


def _ref_inf(kw: dict, keys: tuple[str, ...] = ROLLOUT_KEYS, hooks: tuple = ()) -> MFCDef:
    return MFCDef(
        "ref_inf",
        "ref",
        "inference",
        keys,
        ("ref_logp",),
        output_key_remap={"logp": "ref_logp"},
        pre_hooks=hooks,
        **_common(kw),
    )


def _reward(kw: dict, name: str = "reward_inf", prefix: str = "") -> MFCDef:
    """A reward call: a reward model's inference, or a rule on the host when ``rule_based_reward``."""
    rule = bool(kw.get("rule_based_reward", False))
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
        **_common(kw),
    )


def _train(name: str, model: str, keys: tuple[str, ...], kw: dict, minibatches: bool = True) -> MFCDef:
    n_minibatches = kw.get("n_ppo_minibatches") if minibatches else 1
    return MFCDef(name, model, "train_step", keys, (), n_minibatches=n_minibatches, **_common(kw))


def _ref_calls(kw: dict, hooks: tuple = ()) -> tuple[list[MFCDef], tuple[str, ...]]:
    """The reference call and the key it adds to the train calls' inputs, or nothing without ``use_ref``."""
    if not kw.get("use_ref", True):
        return [], ()
    return [_ref_inf(kw, hooks=hooks)], ("ref_logp",)


def _ppo(kw: dict, ref_hooks: tuple = ()) -> list[MFCDef]:
    ref, ref_keys = _ref_calls(kw, ref_hooks)
    train_keys = GEN_OUTPUT_KEYS + ref_keys + ("values", "rewards")
    return [
        _actor_gen(kw),
        MFCDef("critic_inf", "critic", "inference", ROLLOUT_KEYS, ("values",), **_common(kw)),
        *ref,
        _reward(kw),
        _train("actor_train", "actor", train_keys, kw),
        _train("critic_train", "critic", train_keys, kw),
    ]


def _ppo_ema(kw: dict) -> list[MFCDef]:
    eta = kw.get("ref_ema_eta", DEFAULT_REF_EMA_ETA)
    return _ppo({**kw, "use_ref": True}, ref_hooks=(ParamReallocHook(source="actor", eta=eta),))


def _grpo_like(kw: dict, default_rule: bool) -> list[MFCDef]:
    kw = {"rule_based_reward": default_rule, **kw}
    ref, ref_keys = _ref_calls(kw)
    train_keys = GEN_OUTPUT_KEYS + ref_keys + ("rewards",)
    return [_actor_gen(kw), *ref, _reward(kw), _train("actor_train", "actor", train_keys, kw)]


def _remax(kw: dict) -> list[MFCDef]:
    greedy_out = {k: "greedy_" + k for k in ROLLOUT_KEYS}
    greedy = MFCDef(
        "actor_gen_greedy",
        "actor",
        "generate",
        PROMPT_KEYS,
        tuple(greedy_out.values()),
        output_key_remap=greedy_out,
        greedy=True,
        **_common(kw),
    )
    ref, ref_keys = _ref_calls(kw)
    train_keys = GEN_OUTPUT_KEYS + ref_keys + ("rewards", "greedy_rewards")
    return [
        _actor_gen(kw),
        greedy,
        *ref,
        _reward(kw),
        _reward(kw, name="reward_inf_greedy", prefix="greedy_"),
        _train("actor_train", "actor", train_keys, kw),
    ]


def _dpo(kw: dict) -> list[MFCDef]:
    return [
        _ref_inf(kw, keys=PAIR_KEYS),
        _train("actor_train", "actor", PAIR_KEYS + ("ref_logp",), kw, minibatches=False),
    ]


ALGORITHMS = {
    "ppo": lambda kw: _ppo(kw),
    "ppo_ema": _ppo_ema,
    "grpo": lambda kw: _grpo_like(kw, default_rule=True),
    "rloo": lambda kw: _grpo_like(kw, default_rule=False),
    "remax": _remax,
    "dpo": _dpo,
    "sft": lambda kw: [_train("actor_train", "actor", PAIR_KEYS, kw, minibatches=False)],
    "rm": lambda kw: [_train("reward_train", "reward", PAIR_KEYS[:2], kw, minibatches=False)],
}

_KWARGS = {"n_seqs", "n_mbs", "n_ppo_minibatches", "rule_based_reward", "use_ref", "ref_ema_eta"}


def algorithm_mfcs(name: str, **kw) -> list[MFCDef]:
    """The MFCs of a built-in algorithm.

    Args:
        name: one of ``ppo``, ``ppo_ema``, ``grpo``, ``rloo``, ``remax``, ``dpo``, ``sft``, ``rm``.
        **kw: ``n_seqs`` (sequences per call, default: decided by the workload), ``n_mbs``
            (micro-batches), ``n_ppo_minibatches`` (optimizer steps per RL train call),
            ``rule_based_reward`` (reward computed by a rule on the host instead of a reward
            model; default True for GRPO, False otherwise), ``use_ref`` (PPO, GRPO, RLOO,
            ReMax: keep the KL reference, default True; PPO-EMA always has one), ``ref_ema_eta``
            (PPO-EMA blend factor, default 0.008).

    >>> [m.name for m in algorithm_mfcs("grpo")]
    ['actor_gen', 'ref_inf', 'reward_inf', 'actor_train']
    """
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {sorted(ALGORITHMS)}")
    unknown = set(kw) - _KWARGS
    if unknown:
        raise ValueError(
            f"unknown option(s) {sorted(unknown)} for algorithm {name!r}; expected a subset of {sorted(_KWARGS)}"
        )
    return ALGORITHMS[name](kw)


def algorithm_graph(name: str, **kw) -> nx.DiGraph:
    """The validated dataflow graph of a built-in algorithm (see :func:`algorithm_mfcs`)."""
    graph = build_graph(algorithm_mfcs(name, **kw))
    graph.graph["algorithm"] = name
    return graph
