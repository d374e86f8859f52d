"""Build steps of a run, each a named function: run directory, models, dataflow, worker setup, workers.

``Trainer.__init__`` calls them in order; each can also be used alone (tests, notebooks).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import networkx as nx
import ray
from transformers import AutoConfig

from rlflow.algos.params import AlgorithmParams
from rlflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourceError, ResourcePool
from rlflow.controller.resource_pool import alive_nodes, bundle_resources, bundles_per_node, describe_nodes
from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import build_char_tokenizer, load_tokenizer
from rlflow.dataflow import GraphOptions, MFCDef
from rlflow.engine.loading import build_meta_model
from rlflow.engine.lora import LoraSpec, linear_module_names, lora_strategy_error
from rlflow.engine.models import init_value_model_from_lm, is_sequence_classification, save_model
from rlflow.engine.optim import OptimConfig
from rlflow.engine.parallelize import layer_matmul_params, resolve_compute_dtype
from rlflow.engine.rollout import get_rollout_engine
from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.given import given_count
from rlflow.engine.router_loss import resolve_router_aux_loss_coef
from rlflow.families import family_of, list_families
from rlflow.families.generic import GenericFamily
from rlflow.files import write_atomic
from rlflow.parallel.vllm_layout import vllm_fusion
from rlflow.planner.cluster import local_devices_per_node, local_gpus
from rlflow.planner.compiled import compile_problem
from rlflow.planner.memory import KEEP_COPY_MARGIN, CallMemory, copies_that_fit, peak_bytes_with_kept_copies
from rlflow.planner.simulate import node_table, simulate
from rlflow.trainer.config import ConfigError, ModelConfig, RLFlowConfig, driver_can_host
from rlflow.trainer.hub import resolve_model_dir
from rlflow.trainer.local_ray import RAY_INIT_LOCK, WORKER_ENV, LocalRayStart, init_local_ray
from rlflow.trainer.placement import Placement
from rlflow.trainer.run_dir import TINY_SHAPE_FIELDS
from rlflow.trainer.runner import CallPlacement
from rlflow.workers.environments import MultiTurnSetup
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

logger = logging.getLogger(__name__)

VALUE_ROLES = ("critic", "reward")

# Calls the driver issues besides the algorithm's graph: held-out evaluation (greedy rollout,
# rule-based score) and the SFT warm-up of the actor before RL.
EVAL_GEN, EVAL_REWARD, WARMUP_SFT = "eval_gen", "eval_reward", "warmup_sft"
SCORER = "scorer"  # the rule-based reward of held-out evaluation (a model name without weights)


def resolve_paths(cfg: RLFlowConfig, base: str | Path | None = None) -> RLFlowConfig:
    """The config with every file and directory it names made absolute, against ``base``.

    Workers read model, tokenizer, data and checkpoint paths in their own process, whose working
    directory is not the driver's on a joined cluster (``placement.ray_address``), so the driver
    resolves them first: ``logging.dir`` (its default ``runs/{experiment_name}`` included),
    ``checkpoint.dir``, a ``checkpoint.resume`` path, ``models.<role>.path``, ``data.tokenizer``,
    ``data.train_file`` and ``data.eval_file``. ``~`` is expanded. A model or tokenizer that is no
    local path is a Hugging Face Hub id, replaced by its snapshot directory (:func:`resolve_model_paths`).

    Args:
        cfg: a validated config.
        base: the directory relative paths are read from; default: the current directory.

    Raises:
        ConfigError: an input path (data file) does not exist, or a model or tokenizer is neither
            a local path nor a Hub id in reach; names the key.
    """
    base = Path.cwd() if base is None else Path(base)
    cfg = resolve_model_paths(cfg, base)

    def absolute(key: str, value: str | None, must_exist: bool = False) -> str | None:
        if value is None:
            return None
        path = Path(os.path.abspath(base / Path(value).expanduser()))
        if must_exist and not path.exists():
            where = "" if Path(value).expanduser().is_absolute() else f" (resolved against {base})"
            raise ConfigError(key, f"{value!r} does not exist{where}")
        return str(path)

    d, log, ckpt = cfg.data, cfg.logging, cfg.checkpoint
    data = replace(
        d,
        train_file=absolute("data.train_file", d.train_file, must_exist=True),
        eval_file=absolute("data.eval_file", d.eval_file, must_exist=True),
    )
    run_dir = log.dir if log.dir is not None else os.path.join("runs", cfg.experiment_name)
    resume = ckpt.resume if ckpt.resume in ("none", "auto") else absolute("checkpoint.resume", ckpt.resume)
    return replace(
        cfg,
        data=data,
        logging=replace(log, dir=absolute("logging.dir", run_dir)),
        checkpoint=replace(ckpt, dir=absolute("checkpoint.dir", ckpt.dir), resume=resume),
    )


def resolve_model_paths(cfg: RLFlowConfig, base: str | Path | None = None) -> RLFlowConfig:
    """The config with ``models.<role>.path`` and ``data.tokenizer`` local and absolute.

    A local path is made absolute against ``base`` (default: the current directory); any other
    name is a Hugging Face Hub id, resolved once here to its snapshot in the HF cache
    (:func:`rlflow.trainer.hub.resolve_model_dir`), which the workers then read.

    Raises:
        ConfigError: a name that is neither a local path nor a Hub id in reach; names the key.
    """
    models = {
        role: m if m.path is None else replace(m, path=resolve_model_dir(f"models.{role}.path", m.path, base))
        for role, m in cfg.models.items()
    }
    tokenizer = cfg.data.tokenizer
    if tokenizer is not None:
        tokenizer = resolve_model_dir("data.tokenizer", tokenizer, base)
    return replace(cfg, models=models, data=replace(cfg.data, tokenizer=tokenizer))


def run_dir_of(cfg: RLFlowConfig) -> Path:
    path = Path(cfg.logging.dir or os.path.join("runs", cfg.experiment_name))
    path.mkdir(parents=True, exist_ok=True)
    return path


def materialize_tokenizer(cfg: RLFlowConfig, run_dir: Path) -> str:
    """The tokenizer directory: the configured one, or the built-in character tokenizer saved once."""
    if cfg.data.tokenizer is not None:
        try:
            load_tokenizer(cfg.data.tokenizer)  # fails early with the path in the message
        except ValueError as err:
            raise ConfigError("data.tokenizer", str(err)) from None
        return cfg.data.tokenizer
    path = run_dir / "tokenizer"
    if not (path / "tokenizer.json").is_file():
        build_char_tokenizer().save_pretrained(path)
    return str(path)


def materialize_models(cfg: RLFlowConfig, run_dir: Path, tokenizer_path: str) -> dict[str, str]:
    """Model name -> local HF directory; tiny models are built from the config and saved once.

    ``init: copy`` models get their architecture (and placeholder weights) here: a reference
    reads its source's directory, a critic gets the source's backbone with a fresh value head.
    Their weights proper are copied from the source on the workers when RL starts, after the
    warm-up (``Trainer._copy_models``).
    """
    vocab = len(load_tokenizer(tokenizer_path))
    paths: dict[str, str] = {}
    order = sorted(cfg.models, key=lambda n: cfg.models[n].init == "copy")  # sources first
    for name in order:
        m = cfg.models[name]
        if m.init == "path":
            paths[name] = _checked_family(name, _checked_vocab(name, m.path, vocab, tokenizer_path), cfg.rollout.engine)
        elif m.init == "tiny":
            paths[name] = _save_tiny(m, name, run_dir / "models" / name, vocab, cfg.seed)
        else:
            source = paths[m.init_from]
            paths[name] = _copy_model(name, source, run_dir / "models" / name)
    _checked_router_loss(cfg, paths)
    if "teacher" in paths and "actor" in paths:
        _check_teacher_vocab(paths["teacher"], paths["actor"])
    return paths


def _check_teacher_vocab(teacher: str, actor: str) -> None:
    """The distillation teacher scores the student's token ids: both must share one vocabulary.

    Raises:
        ConfigError: the two models' ``vocab_size`` differ (names ``models.teacher``).
    """
    sizes = [json.loads((Path(p) / "config.json").read_text()).get("vocab_size") for p in (teacher, actor)]
    if sizes[0] != sizes[1]:
        raise ConfigError(
            "models.teacher",
            f"{teacher}: vocab_size={sizes[0]}, but the student (models.actor, {actor}) has vocab_size={sizes[1]}; "
            "a distillation teacher must share the student's tokenizer and vocabulary",
        )


def _checked_vocab(name: str, path: str, vocab: int, tokenizer_path: str) -> str:
    """``path``, once its embedding holds every token id of the tokenizer (a mismatch fails here, not in a worker).

    A sequence-classification reward model is exempt: it scores the text, tokenized again by its
    own tokenizer (:mod:`rlflow.workers.interfaces.reward`), never the run's token ids.
    """
    config = Path(path) / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    size = hf.get("vocab_size")
    own_tokenizer = any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or [])
    if size is not None and size < vocab and not own_tokenizer:
        raise ConfigError(
            f"models.{name}.path",
            f"{path}: vocab_size={size} < the {vocab} tokens of the tokenizer {tokenizer_path}; "
            "give the model's own tokenizer (Trainer(tokenizer=...) or data.tokenizer)",
        )
    return path


def _checked_family(name: str, path: str, rollout_engine: str) -> str:
    """``path``, once rlflow can run its model: a hand-written family, or the generic family of a
    causal LM whose HF forward a decoder stage computes and that ``rollout_engine`` generates with
    plain HF modules (a model that cannot fails here, not in a worker).

    A sequence-classification reward model is exempt: it is scored through HF's own forward.
    """
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if is_sequence_classification(config):
        return path
    try:
        family = family_of(config)
    except ValueError as err:
        raise ConfigError(f"models.{name}.path", f"{path}: {err}") from None
    if isinstance(family, GenericFamily):
        # The engines' import (HF's modeling code) only where a model of no record is checked:
        # a construction that only plans a run leaves it to the processes that build models.
        from rlflow.engine.pipeline import stage_forward_mismatch

        reason = stage_forward_mismatch(config, family.causal_lm_class)
        if reason is not None:
            raise ConfigError(
                f"models.{name}.path",
                f"{path}: rlflow cannot train model_type={config.model_type!r}: {reason}. It trains the families "
                f"{list_families()} and transformers' causal LMs whose forward is embedding -> layers -> norm -> head",
            )
        engine = get_rollout_engine(rollout_engine)
        causal = any(a.endswith("ForCausalLM") for a in config.architectures or [])
        if causal and engine.layout_style == "vllm":
            _check_vllm_layout(name, config, rollout_engine)
        elif causal and engine.layout_style != "hf":
            raise ConfigError(
                "rollout.engine",
                f"{rollout_engine!r} generates with its own fused {engine.layout_style!r} layout, which rlflow maps for "
                f"the families {list_families()} only; models.{name} is a {config.model_type!r} model: use "
                "rollout.engine=hf (the built-in sampler)",
            )
    return path


def _check_vllm_layout(name: str, config: AutoConfig, rollout_engine: str) -> None:
    """Refuse, before any worker starts, a generic-family model whose layers vLLM's own model class
    lays out in a way rlflow does not map (:func:`rlflow.parallel.vllm_layout.vllm_fusion`, which
    reads vLLM's model registry: vLLM must be installed where the run is constructed)."""
    try:
        vllm_fusion(config)
    except (ImportError, ValueError) as err:
        raise ConfigError(
            "rollout.engine",
            f"{rollout_engine!r} cannot generate models.{name} ({config.model_type!r}): {err}; use rollout.engine=hf "
            "(the built-in sampler)",
        ) from None


# Beside a model the run built from its config: what it was built from. Another config (a new seed,
# another shape) rebuilds it rather than train the earlier run's initial weights.
BUILT_FROM = "rlflow_built_from.json"


def _built_from(path: Path, spec: dict) -> bool:
    record = path / BUILT_FROM
    return (path / "config.json").is_file() and record.is_file() and json.loads(record.read_text()) == spec


def _record_built_from(path: Path, spec: dict) -> None:
    write_atomic(path / BUILT_FROM, json.dumps(spec, sort_keys=True))


def _save_tiny(m: ModelConfig, name: str, path: Path, vocab: int, seed: int) -> str:
    spec = {"role": name, "vocab_size": vocab, "seed": seed, **{f: getattr(m, f) for f in TINY_SHAPE_FIELDS}}
    if not _built_from(path, spec):
        model = build_tiny_model(
            family=m.family,
            vocab_size=vocab,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size,
            tie_word_embeddings=m.tie_word_embeddings,
            seed=seed,
        )
        save_model(model, path)
        if name in VALUE_ROLES:  # a value model gets the tiny backbone and a fresh scalar head
            save_model(init_value_model_from_lm(path), path)
        _record_built_from(path, spec)
    return str(path)


def _copy_model(name: str, source: str, path: Path) -> str:
    if name not in VALUE_ROLES:
        return source  # a frozen copy reads the same weights; nothing to write
    source_record = Path(source) / BUILT_FROM
    spec = {
        "source": source,
        "source_config": json.loads((Path(source) / "config.json").read_text()),
        "source_built_from": json.loads(source_record.read_text()) if source_record.is_file() else None,
    }
    if not _built_from(path, spec):
        save_model(init_value_model_from_lm(source), path)
        _record_built_from(path, spec)
    return str(path)


def build_dataflow(cfg: RLFlowConfig, rule_reward: bool) -> nx.DiGraph:
    """The algorithm's dataflow graph with the config's mini-batches, reward source, reference and teacher use,
    and old-log-prob recompute (``algorithm.recompute_old_logp``; the graph records why in ``old_logp_mismatch``)."""
    algo = cfg.algorithm
    options = GraphOptions(
        n_ppo_minibatches=algo.n_minibatches,
        rule_based_reward=rule_reward,
        use_ref="ref" in cfg.required_models(),  # a KL term reads it; without one it is not built
        use_teacher="teacher" in cfg.required_models(),  # on-policy distillation: its advantage reads it
        teacher_vocab=algo.distill_loss == "full_vocab",  # the full-vocabulary KL loss reads its distributions
        ref_ema_eta=algo.ema_eta,
        recompute_old_logp=algo.recomputes_old_logp(cfg.rollout, cfg.placement.use_gpu, cfg.model_dtype("actor")),
        token_versions=cfg.rollout.partial_tokens > 0,
    )
    graph = algo.record.graph(options)
    graph.graph["old_logp_mismatch"] = algo.old_logp_mismatch(
        cfg.rollout, cfg.placement.use_gpu, cfg.model_dtype("actor")
    )
    if algo.distill_student_fraction < 1:
        _price_the_sampled_share(graph, cfg)
    return graph


def _price_the_sampled_share(graph: nx.DiGraph, cfg: RLFlowConfig) -> None:
    """GKD's mixed rollouts (``algorithm.distill_student_fraction``): the actor's sampling call samples
    the student's share of the prompts (the rest take given completions), so the planner prices it
    for those sequences; the calls after it read every row of the step."""
    algo = cfg.algorithm
    batch = cfg.data.batch_size
    prompts = max(1, batch - given_count(batch, algo.distill_student_fraction))
    for name in graph.nodes:
        mfc = graph.nodes[name]["mfc"]
        if mfc.interface_type == "generate" and not mfc.greedy and mfc.model_name == "actor":
            graph.nodes[name]["mfc"] = replace(mfc, n_seqs=prompts * algo.n_samples)


def extra_calls(
    cfg: RLFlowConfig,
    calls: Mapping[str, CallPlacement],
    reward_fn: str | None,
    workers: Sequence[int] | None = None,
) -> dict[str, CallPlacement]:
    """Placements of the evaluation and warm-up calls, on the layouts the plan already uses.

    Evaluation generates where the algorithm generates (or on the actor's home when the graph
    has no rollout) and scores data-parallel on the started workers (``workers``; default every
    worker of the pool).
    """
    home = next((c for c in calls.values() if c.mfc.model_name == "actor" and c.mfc.is_train), None)
    gen = next((c for c in calls.values() if c.mfc.interface_type == "generate" and c.mfc.model_name == "actor"), None)
    if home is None and gen is None:
        return {}
    extra: dict[str, CallPlacement] = {}
    if reward_fn is not None:
        src = gen or home
        strategy = src.strategy if src.strategy.pp == 1 else type(src.strategy)(dp=len(src.ranks))
        eval_gen = MFCDef(EVAL_GEN, "actor", "generate", ("prompts", "prompt_mask"), _GEN_KEYS)
        hooks = gen.hook_ranks if gen is not None else tuple(sorted(src.ranks))
        extra[EVAL_GEN] = CallPlacement(eval_gen, src.ranks, strategy, hooks)
        everyone = tuple(workers) if workers is not None else _all_ranks(cfg)
        score = MFCDef(EVAL_REWARD, SCORER, "inference", (*_GEN_KEYS[:3], "answers"), ("rewards",), runs_on_host=True)
        extra[EVAL_REWARD] = CallPlacement(score, everyone, type(src.strategy)(dp=len(everyone)))
    if cfg.warmup.steps > 0 and home is not None:
        sft = MFCDef(WARMUP_SFT, "actor", "train_step", ("input_ids", "attention_mask", "loss_mask"), objective="sft")
        extra[WARMUP_SFT] = CallPlacement(sft, home.ranks, home.strategy)
    return extra


_GEN_KEYS = ("input_ids", "attention_mask", "response_mask", "old_logp")


def _all_ranks(cfg: RLFlowConfig) -> tuple[int, ...]:
    return tuple(range(cfg.placement.num_nodes * cfg.placement.devices_per_node))


def model_setups(
    cfg: RLFlowConfig,
    paths: Mapping[str, str],
    calls: Mapping[str, CallPlacement],
    reward_fn: str | None,
    use_gpu: bool = False,
) -> dict[str, ModelSetup]:
    """One :class:`ModelSetup` per model the calls use; a rule-based reward has no weights.

    Each model's ``dtype`` is resolved here, once, for GPU or CPU workers (``auto`` reads this
    host's CPU flags), so that every worker computes in the same precision.
    """
    trained = {c.mfc.model_name for c in calls.values() if c.mfc.is_train}
    rule = {"role": "reward", "path": None, "reward_fn": reward_fn, "reward_errors": cfg.algorithm.reward_errors}
    setups = {}
    for name in sorted({c.mfc.model_name for c in calls.values()}):
        if name == SCORER:
            setups[name] = ModelSetup(name=name, **rule)
            continue
        if name not in cfg.models:
            if name != "reward" or reward_fn is None:
                raise ValueError(f"the dataflow needs model {name!r}; add models.{name} to the config")
            setups[name] = ModelSetup(name=name, **rule)
            continue
        m = cfg.models[name]
        trainable = name in trained if m.trainable is None else m.trainable
        setups[name] = ModelSetup(
            name=name,
            role=name,
            path=paths[name],
            trainable=trainable,
            optim=_optim(cfg, m) if trainable else None,
            gradient_checkpointing=m.gradient_checkpointing,
            shared_prefix=m.shared_prefix,
            fused_cpu_ops=m.fused_cpu_ops,
            max_tokens_per_micro_batch=m.micro_batch_tokens,
            value_head=name in VALUE_ROLES,
            compute_dtype=resolve_compute_dtype(
                m.dtype, "cuda" if use_gpu else "cpu", _layer_params(paths[name]), cfg.pass_tokens(name)
            ),
            lora=_lora_spec(cfg, name, paths[name], calls) if m.lora is not None else None,
            router_aux_loss_coef=_router_aux_loss_coef(cfg, name, paths[name], calls),
        )
    return setups


def _router_aux_loss_coef(cfg: RLFlowConfig, name: str, path: str, calls: Mapping[str, CallPlacement]) -> float | None:
    """``models.<name>.router_aux_loss_coef``, once no train call of a mixture-of-experts model with
    its router loss on runs with pp > 1 (a manual plan; the planner offers such calls pp = 1 only).

    Raises:
        ConfigError: such a call.
    """
    key, override = f"models.{name}.router_aux_loss_coef", cfg.models[name].router_aux_loss_coef
    for call in calls.values():
        if call.mfc.model_name == name and call.mfc.is_train and call.strategy.pp > 1 and override != 0:
            coef = resolve_router_aux_loss_coef(AutoConfig.from_pretrained(path, local_files_only=True), override, key)
            if coef > 0:
                raise ConfigError(
                    key, f"{coef}: the router auxiliary loss runs with pp=1; place {call.mfc.name!r} with pp=1 or set 0"
                )
    return override


def _checked_router_loss(cfg: RLFlowConfig, paths: Mapping[str, str]) -> None:
    """A positive ``models.<name>.router_aux_loss_coef`` is refused for a model without a router."""
    for name, m in cfg.models.items():
        if m.router_aux_loss_coef:
            key = f"models.{name}.router_aux_loss_coef"
            try:
                config = AutoConfig.from_pretrained(paths[name], local_files_only=True)
                resolve_router_aux_loss_coef(config, m.router_aux_loss_coef, key)
            except ValueError as err:
                raise ConfigError(key, str(err).removeprefix(f"{key}={m.router_aux_loss_coef}: ")) from None


def _lora_spec(cfg: RLFlowConfig, name: str, path: str, calls: Mapping[str, CallPlacement]) -> LoraSpec:
    """``models.<name>.lora`` as the engine's spec, checked against the model and its training strategy.

    Raises:
        ConfigError: a target module the model's decoder layers do not have (naming the ones they
            have), or a train call placed with tp or pp > 1.
    """
    lora = cfg.models[name].lora
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    linears = linear_module_names(build_meta_model(config, "lm"))
    unknown = [t for t in lora.target_modules if t not in linears]
    if unknown:
        raise ConfigError(
            f"models.{name}.lora.target_modules",
            f"{unknown} match no linear module of the model's decoder layers; its linear modules are {linears}",
        )
    for call in calls.values():
        if call.mfc.model_name == name and call.mfc.is_train:
            why = lora_strategy_error(call.strategy.tp, call.strategy.pp)
            if why:
                raise ConfigError(f"models.{name}.lora", f"{why}; place {call.mfc.name!r} with tp=1 and pp=1")
    return LoraSpec(
        r=lora.r,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=tuple(lora.target_modules),
        seed=cfg.seed,
        base_model=str(Path(path).resolve()),
        push=lora.push,
    )


def _layer_params(path: str) -> int | None:
    """Multiplying parameters of one decoder layer of the model at ``path`` (what ``dtype: auto`` weighs on CPUs)."""
    config = Path(path) / "config.json"
    return layer_matmul_params(json.loads(config.read_text())) if config.is_file() else None


def _optim(cfg: RLFlowConfig, m: ModelConfig) -> OptimConfig:
    steps_per_iteration = cfg.algorithm.n_minibatches * cfg.algorithm.ppo_epochs
    return OptimConfig(
        lr=m.lr,
        weight_decay=m.weight_decay,
        betas=tuple(m.betas),
        eps=m.eps,
        warmup_steps=m.warmup_steps,
        # A constant schedule has no horizon; a cosine one decays over the whole run.
        total_steps=max(m.warmup_steps, cfg.trainer.total_steps * steps_per_iteration)
        if m.lr_schedule == "cosine"
        else None,
        min_lr_ratio=m.min_lr_ratio,
        max_grad_norm=m.grad_clip,
    )


def sampling_params(cfg: RLFlowConfig, eos_token_id: int | None) -> tuple[SamplingParams, SamplingParams]:
    """Rollout and evaluation sampling settings (eval: greedy unless configured otherwise).

    A response ends at the tokenizer's EOS, as the SFT data taught the model to end answers.
    """
    r = cfg.rollout
    stop = () if eos_token_id is None else (eos_token_id,)
    common = {"max_new_tokens": r.max_new_tokens or cfg.data.max_response_len, "seed": cfg.seed, "stop_token_ids": stop}
    n = cfg.algorithm.n_samples if cfg.algorithm.record.samples_responses else 1
    sample = SamplingParams(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=n, min_new_tokens=r.min_new_tokens, **common
    )
    evaluate = (
        SamplingParams(greedy=True, **common)
        if r.eval_greedy
        else SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=1, **common)
    )
    return sample, evaluate


def worker_setup(
    cfg: RLFlowConfig,
    calls: Mapping[str, CallPlacement],
    paths: Mapping[str, str],
    tokenizer_path: str,
    reward_fn: str | None,
    placement: Placement | None = None,
    use_gpu: bool = False,
    multi_turn: MultiTurnSetup | None = None,
) -> WorkerSetup:
    """The :class:`WorkerSetup` every worker gets; ``placement`` (the planner's outcome, for
    workers on GPUs when ``use_gpu``) decides ``keep_copies`` when ``placement.keep_copies`` is
    null (:func:`kept_copies`).

    Raises:
        ConfigError: ``multi_turn`` with a generate call placed tensor- or pipeline-parallel.
    """
    if multi_turn is not None:
        check_multi_turn_calls(calls)
    sample, evaluate = sampling_params(cfg, load_tokenizer(tokenizer_path).eos_token_id)
    models = model_setups(cfg, paths, calls, reward_fn, use_gpu)
    return WorkerSetup(
        models=models,
        mfcs={name: c.mfc for name, c in calls.items()},
        layouts={name: CallLayout(c.ranks, c.strategy) for name, c in calls.items()},
        algo=worker_algorithm(cfg),
        sampling=sample,
        eval_sampling=evaluate,
        tokenizer_path=str(Path(tokenizer_path).resolve()),
        seed=cfg.seed,
        keep_copies=kept_copies(cfg, [n for n, m in models.items() if not m.rule_based], placement, use_gpu),
        rollout_engine=cfg.rollout.engine,
        rollout_memory_fraction=cfg.rollout.gpu_memory_utilization,
        log_level=cfg.logging.level,
        multi_turn=multi_turn,
    )


def worker_algorithm(cfg: RLFlowConfig) -> AlgorithmParams:
    """The algorithm the workers get (:meth:`AlgorithmParams.resolved`); ``behaviour_correction: auto``
    is decoupled under partial rollouts too (``rollout.partial_tokens``): their carried tokens were
    sampled by older weights."""
    algo = cfg.algorithm.resolved()
    if cfg.rollout.partial_tokens and cfg.algorithm.behaviour_correction == "auto":
        algo = replace(algo, behaviour_correction="decoupled")
    return algo


def check_multi_turn_calls(calls: Mapping[str, CallPlacement]) -> None:
    """Multi-turn episodes run on one process per dp rank (the hf or vllm engine): every generate
    call of the actor must be placed with tp = pp = 1 (an episode's tools would run once per rank)."""
    for name, c in calls.items():
        if c.mfc.interface_type == "generate" and (c.strategy.tp > 1 or c.strategy.pp > 1):
            raise ConfigError(
                "rollout.multi_turn",
                f"the plan places generate call {name!r} on {c.strategy}; multi-turn rollouts need one process "
                "per dp rank (tp = pp = 1: set placement.manual or fewer devices)",
            )


def kept_copies(
    cfg: RLFlowConfig, models: list[str], placement: Placement | None, use_gpu: bool = False
) -> tuple[str, ...]:
    """The models whose copies the workers keep between calls (``WorkerSetup.keep_copies``); prints why.

    ``placement.keep_copies`` true: every model with weights; false: none; null: the models whose
    copies, made static memory, keep every device's peak under the planner's memory model within
    ``1 - KEEP_COPY_MARGIN`` of its memory (:func:`rlflow.planner.memory.copies_that_fit`); none
    without a plan. On CPU workers the device memory is the host's share per worker.
    """
    setting = cfg.placement.keep_copies
    if setting is not None:
        kept = tuple(sorted(models)) if setting else ()
        logger.info(f"keep_copies={setting} (placement.keep_copies): kept copies of {list(kept)}")
        return kept
    if placement is None or placement.plan is None:
        logger.info("keep_copies=null: no device plan to price kept copies with; copies are freed after each call")
        return ()
    problem, plan = placement.problem, placement.plan
    choice = [problem.option_index(i, c.mesh, c.strategy) for i, c in enumerate(plan.calls)]
    cp = compile_problem(problem)
    copy = node_table(cp, cp.check_choice(choice))[3]
    memory = []
    for i, j in enumerate(choice):
        o = problem.options[i][j]
        memory.append(
            CallMemory(
                problem.models[problem.mfc_models[i]].name,
                tuple(o.mesh.device_ids),
                o.act_bytes,
                o.weight_bytes if copy[i] else 0.0,
                (o.mesh, o.strategy, o.replicated),
            )
        )
    static = simulate(cp, choice).static_bytes
    kept = tuple(m for m in copies_that_fit(static, memory, problem.device_memory_bytes) if m in models)
    peak = max(peak_bytes_with_kept_copies(static, memory, kept))
    where = "GPU memory" if use_gpu else "CPU workers: the host memory's share of each worker"
    logger.info(
        f"keep_copies=null (planner's memory model): kept copies of {list(kept)}, freed for "
        f"{sorted({c.model for c in memory if c.copy_bytes > 0} - set(kept))}; peak {peak / 2**30:.3f} GiB of "
        f"{problem.device_memory_bytes / 2**30:.3f} GiB per device ({where}; {KEEP_COPY_MARGIN:.0%} kept free)"
    )
    return kept


def with_hook_ranks(calls: Mapping[str, CallPlacement], setup: WorkerSetup) -> dict[str, CallPlacement]:
    """The placements with the ranks of each call's pre/post hooks, as the workers define them."""
    return {name: replace(c, hook_ranks=setup.hook_ranks(name)) for name, c in calls.items()}


def ensure_ray(cfg: RLFlowConfig, pending: LocalRayStart | None = None) -> bool:
    """Joins the configured Ray cluster, or starts a local one with this machine's cores (with
    Ray's dashboard only when ``placement.ray_dashboard`` asks for it); then refuses a config the
    cluster cannot hold (:func:`check_cluster`), before anything is planned or started.

    Args:
        cfg: the run's config.
        pending: the local Ray ``Trainer(...)`` began on a thread (:mod:`rlflow.trainer.local_ray`):
            waited for and taken over when it is the Ray ``cfg`` asks for, else shut down first.

    Returns:
        Whether this call (or ``pending``) started a local Ray instance (its caller then shuts it
        down). False when Ray was already initialised (a notebook's or a test session's own
        ``ray.init``) and when it joined a cluster: the driver stays connected, as a notebook on a
        cluster expects.

    Raises:
        ResourceError: the workers need more CPUs than this machine has cores (a local Ray,
            without ``placement.oversubscribe``), or more nodes or devices than the cluster has;
            a local Ray this call started is shut down first.
    """
    p = cfg.placement
    started = pending is not None and pending.wait()
    try:
        if started and (
            p.ray_address is not None
            or p.ray_dashboard != pending.include_dashboard
            or local_ray_cpus(cfg) != pending.num_cpus
        ):
            ray.shutdown()  # not the Ray this config asks for
            started = False
        with RAY_INIT_LOCK:
            if not ray.is_initialized():
                if p.ray_address is not None:
                    ray.init(address=p.ray_address, runtime_env={"env_vars": dict(WORKER_ENV)}, log_to_driver=True)
                else:
                    # its web server and agents delay a local start: the dashboard is off unless asked
                    init_local_ray(local_ray_cpus(cfg), p.ray_dashboard)
                    started = True
        check_cluster(cfg, uses_gpu(cfg))
    except ResourceError:
        if started:
            ray.shutdown()
        raise
    return started


def local_ray_cpus(cfg: RLFlowConfig, cores: int | None = None) -> int:
    """The CPUs a local Ray is started with: this machine's cores (``cores``; default those this
    process may run on), or with ``placement.oversubscribe`` as many as the workers reserve.

    A local Ray is one node: ``placement.devices_per_node`` workers of ``placement.cpus_per_worker``
    CPUs each (more nodes are refused by :func:`check_cluster`).

    >>> from rlflow.trainer.config import load_config
    >>> local_ray_cpus(load_config(None, ["placement.devices_per_node=2"]), cores=4)
    4

    Raises:
        ResourceError: the workers reserve more CPUs than there are cores, without oversubscription.
    """
    p = cfg.placement
    cores = local_devices_per_node(use_gpu=False) if cores is None else cores
    asked = p.devices_per_node * p.cpus_per_worker
    if asked <= cores + 1e-9:
        return cores
    if p.oversubscribe:
        return math.ceil(asked - 1e-9)
    kind = "" if p.use_gpu else "CPU "
    raise ResourceError(
        f"placement.devices_per_node={p.devices_per_node} asks for {p.devices_per_node} {kind}workers but this "
        f"machine has {cores} cores ({p.devices_per_node} x placement.cpus_per_worker={p.cpus_per_worker:g} = "
        f"{asked:g} CPUs); use fewer workers (placement.devices_per_node <= {math.floor(cores / p.cpus_per_worker)}), "
        "or set placement.oversubscribe=true to let them share the cores"
    )


def check_cluster(cfg: RLFlowConfig, use_gpu: bool) -> None:
    """Refuses a config that asks for more nodes or devices than the Ray cluster has, in every
    placement mode, before the planner or any worker starts.

    Raises:
        ResourceError: naming the field (``placement.num_nodes``, ``placement.devices_per_node``)
            and what the cluster has.
    """
    p = cfg.placement
    nodes = alive_nodes()
    if len(nodes) < p.num_nodes:
        hint = "; a local Ray is one node: join a cluster with placement.ray_address" if p.ray_address is None else ""
        raise ResourceError(f"placement.num_nodes={p.num_nodes}, but the Ray cluster has {len(nodes)} node(s){hint}")
    bundle = bundle_resources(use_gpu, p.cpus_per_worker)
    room = sorted(bundles_per_node(bundle, nodes), reverse=True)[: p.num_nodes]
    if min(room) < p.devices_per_node:
        kind, gpu = ("GPU", " and 1 GPU") if use_gpu else ("CPU", "")
        held = ", ".join(map(str, room))
        raise ResourceError(
            f"placement.devices_per_node={p.devices_per_node} asks for {p.devices_per_node} {kind} workers on each of "
            f"{p.num_nodes} node(s) (placement.cpus_per_worker={p.cpus_per_worker:g} CPU{gpu} each), but the Ray "
            f"cluster's {p.num_nodes} largest node(s) hold {held}; {describe_nodes(nodes)}"
        )


def uses_gpu(cfg: RLFlowConfig) -> bool:
    if cfg.placement.use_gpu is not None:
        return cfg.placement.use_gpu
    return bool(ray.cluster_resources().get("GPU", 0))


def local_uses_gpu(cfg: RLFlowConfig) -> bool:
    """:func:`uses_gpu` without Ray: ``placement.use_gpu``, else whether torch sees a GPU here."""
    if cfg.placement.use_gpu is not None:
        return cfg.placement.use_gpu
    return local_gpus() > 0


def driver_may_host(cfg: RLFlowConfig) -> bool:
    """Whether a plan of one worker runs it in the driver (``placement.worker_host``; decided
    before Ray is touched: with ``auto`` only a CPU run with no Ray in this process and no
    cluster named, in the config or by ``RAY_ADDRESS``, whose rollout engine is built per call
    — one kept per process, as vLLM's, keeps its worker process)."""
    p = cfg.placement
    if p.worker_host != "auto":
        return p.worker_host == "driver"
    return (
        driver_can_host(cfg.rollout.engine)
        and p.ray_address is None
        and p.num_nodes == 1
        and not os.environ.get("RAY_ADDRESS")
        and not ray.is_initialized()
        and not local_uses_gpu(cfg)
    )


def worker_ranks(cfg: RLFlowConfig, used: Sequence[int]) -> tuple[int, ...]:
    """The ranks to start workers for: on one node, ranks ``0..k-1`` when the plan uses only
    those (a plan may leave devices idle: :attr:`Placement.used_ranks`); else every rank of the pool.

    >>> from rlflow.trainer.config import load_config
    >>> worker_ranks(load_config(None, ["placement.devices_per_node=2"]), (0,))
    (0,)
    """
    everyone = _all_ranks(cfg)
    used = tuple(sorted(used))
    if cfg.placement.num_nodes == 1 and used and used == tuple(range(len(used))):
        return used
    return everyone


def start_workers(
    cfg: RLFlowConfig,
    setup: WorkerSetup,
    use_gpu: bool,
    ranks: Sequence[int] | None = None,
    in_driver: bool = False,
    threads: int = 1,
) -> tuple[RayWorkerGroup, ResourcePool | None]:
    """One :class:`ModelWorker` per rank (default every device of the pool; see :func:`worker_ranks`);
    process groups and models built.

    Args:
        in_driver: run the one worker (``ranks`` must be ``(0,)``) in this process, without Ray
            (:meth:`RayWorkerGroup.in_driver`).
        threads: torch threads of each CPU worker (:attr:`Placement.threads`).

    Returns:
        The worker group and its resource pool (None for a driver-hosted worker);
        ``pool.release()`` after ``group.shutdown()`` hands the pool's placement groups back to
        Ray (a later run in the same cluster needs them).
    """
    from rlflow.workers.model_worker import ModelWorker  # the engines' imports: only a launch needs them

    if in_driver:
        if ranks is None or tuple(ranks) != (0,):
            raise ValueError(f"a driver-hosted worker is rank 0 of 1, got ranks {ranks}")
        group = RayWorkerGroup.in_driver(
            RayClassWithInitArgs(ModelWorker, setup), role="model", use_gpu=use_gpu, threads=threads
        )
        try:
            group.init_process_group()
            group.build()
        except BaseException:
            group.shutdown()
            raise
        return group, None
    p = cfg.placement
    everyone = _all_ranks(cfg)
    if ranks is not None and tuple(ranks) != everyone:
        if tuple(ranks) != tuple(range(len(ranks))) or p.num_nodes != 1:
            raise ValueError(f"workers can start for ranks 0..k-1 of one node only, got {tuple(ranks)}")
        sizes = [len(ranks)]
    else:
        sizes = [p.devices_per_node] * p.num_nodes
    pool = ResourcePool(sizes, use_gpu=use_gpu, cpus_per_worker=p.cpus_per_worker, threads_per_worker=threads)
    try:
        group = RayWorkerGroup(pool, RayClassWithInitArgs(ModelWorker, setup), role="model")
        group.init_process_group()
        group.build()
    except BaseException:
        pool.release()
        raise
    return group, pool
