"""rlflow against TRL's ``GRPOTrainer`` on the same GRPO tasks: completions/s, start-up, reward per sample.

Issue 12's goal: on the 2-core machine, rlflow's default setup delivers at least 2x the
completions per second of TRL's ``GRPOTrainer`` (its faster of 1 and 2 torch threads) on the
same tiny-model GRPO task, learning at least as well per sample. Both trainers run the tasks
of :data:`benchmarks.grpo_tasks.TASKS` from the same initial weights (one model built with
``build_tiny_model`` and saved with rlflow's character tokenizer), the arithmetic task's
train prompts and the ``numeric_match`` rule, each in a process of its own, interleaved:

* **TRL**: ``benchmarks/trl_grpo.py`` in a venv of its own (``.venv-trl/``, made on first use:
  the main venv's torch and transformers versions, then :data:`TRL_REQUIREMENT`), with 1 and
  with 2 torch threads;
* **rlflow**: ``benchmarks/rlflow_grpo.py`` in this venv, ``Trainer(config).fit()`` with the
  default placement on two CPU worker processes, and again with ``algorithm.policy_lag: 1``
  when the config accepts that field (otherwise the record says why it was skipped).

Each run writes event lines (``train_begin``, one ``step`` per optimizer step, ``done``);
:func:`benchmarks.grpo_tasks.summarize` gives completions/s (first step excluded), step time
median and p90, start-up seconds and the reward per step. One record per run, one per task
with ``ratio`` = rlflow's completions/s / TRL's best, and a PNG of the smoothed reward
against samples seen per task in the output directory.

    python -m benchmarks.run trl

Environment: ``RLFLOW_BENCH_TRL_TASKS`` (``tiny,main,compute``), ``RLFLOW_BENCH_TRL_TINY_STEPS`` (150),
``RLFLOW_BENCH_TRL_MAIN_STEPS`` (30), ``RLFLOW_BENCH_TRL_COMPUTE_STEPS`` (12), ``RLFLOW_BENCH_TRL_REPEATS`` (1),
``RLFLOW_BENCH_TRL_THREADS`` (``1,2``: TRL's torch thread counts; on a busy machine a 2-thread
process spin-waits for its second core, so ``1`` there), ``RLFLOW_BENCH_TRL_PRECISIONS``
(``fp32,bf16``: TRL in float32 and with HF Trainer's ``bf16=True``; each with each thread count),
``RLFLOW_BENCH_TRL_WARM_START_STEPS`` (0: random initial weights; N: both start from the model
after N supervised steps on the task's answers, :func:`warm_start`),
``RLFLOW_BENCH_TRL_LR`` (the task's: both sides' learning rate; a warm-started tiny model
collapses to reward 0 within three steps at the tiny task's 1e-3, on both sides),
``RLFLOW_BENCH_TRL_SEED`` (the task's, 0: the initial model, its warm start, the prompts and both
trainers' sampling; other seeds give independent replicates of a learning comparison),
``RLFLOW_BENCH_TRL_MODEL_SEED`` (the run's seed: the initial model and its warm start alone; set,
the runs of several ``RLFLOW_BENCH_TRL_SEED`` s start from one warm start and differ only in
prompts and sampling — most warm starts of the tiny task answer too rarely for a signal),
``RLFLOW_BENCH_TRL_OUT`` (``outputs/bench_trl``), ``RLFLOW_BENCH_TRL_VENV`` (``.venv-trl``).

An AVX2 machine's speeds on an AVX-512 host: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2`` cap the instruction sets of torch's kernels in this process and
every run it starts (rlflow then computes in fp32: :func:`rlflow.engine.parallelize.cpu_computes_bf16`),
with ``RLFLOW_BENCH_TRL_PRECISIONS=fp32``: capped, bf16 matmuls fall to oneDNN's reference kernels,
far slower than an AVX2 CPU's own bf16 (which is itself slower than fp32 there). The records'
``machine`` names the caps in effect. The host's caches, memory and clock stay its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.grpo_tasks import TASKS, rlflow_config, smooth, summarize

ROOT = Path(__file__).resolve().parents[1]
TRL_REQUIREMENT = "trl==1.16.0"  # the version whose GRPOConfig field names trl_grpo.py uses
NUM_PROMPTS_FILE = 4096  # distinct train prompts TRL cycles through (rlflow draws from the same split)
RUN_TIMEOUT_S = 1800


def _env_int(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _env_tasks() -> list[str]:
    names = [n.strip() for n in os.environ.get("RLFLOW_BENCH_TRL_TASKS", "tiny,main,compute").split(",") if n.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise ValueError(f"RLFLOW_BENCH_TRL_TASKS={names}: expected names among {sorted(TASKS)}")
    return names


# ----------------------------------------------------------------------------- TRL's venv


def trl_python() -> Path:
    """The python of TRL's venv, made on first use with this venv's torch and transformers.

    The venv is remade only when the requirements recorded in it differ from today's.
    """
    import torch
    import transformers

    venv = Path(os.environ.get("RLFLOW_BENCH_TRL_VENV", ROOT / ".venv-trl"))
    python = venv / "bin" / "python"
    requirements = [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}"]
    requirements.append(TRL_REQUIREMENT)
    stamp = venv / ".rlflow-bench-requirements"
    if python.exists() and stamp.is_file() and stamp.read_text().split() == requirements:
        return python
    print(f"# making TRL's venv {venv}: {' '.join(requirements)}", file=sys.stderr, flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, requirements[0]], check=True)  # torch first: its CPU build, as `make install` does
    subprocess.run([*pip, *requirements], check=True)
    stamp.write_text(" ".join(requirements) + "\n")
    return python


# ----------------------------------------------------------------------------- one run


def warm_start(model, tokenizer, task, steps: int, seed: int, batch_size: int = 64, lr: float = 1e-3) -> list[float]:
    """Supervised steps on ``task``'s train answers (loss on answer + eos), in place; the losses.

    Off by default: from random weights neither trainer learns these tasks within the default
    steps, so the reward curves compare nothing. A shared warm start that sometimes answers
    right gives GRPO a signal; it is applied once, before either trainer sees the model.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like both trainers; 2 threads spin-wait on a busy 2-core machine
    try:
        return _supervised_steps(model, tokenizer, task, steps, seed, batch_size, lr)
    finally:
        torch.set_num_threads(threads)


def _supervised_steps(model, tokenizer, task, steps: int, seed: int, batch_size: int, lr: float) -> list[float]:
    import torch

    from rlflow.data.datasets import pad_sequences

    torch.manual_seed(seed)
    examples = task.sample("train", min(steps * batch_size, 8000), seed=seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        start = (step * batch_size) % len(examples)
        batch = (examples + examples)[start : start + batch_size]
        prompts = [tokenizer(e.prompt)["input_ids"] for e in batch]
        answers = [tokenizer(e.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for e in batch]
        ids = pad_sequences([p + a for p, a in zip(prompts, answers)], tokenizer.pad_token_id, "right")
        labels = pad_sequences([[-100] * len(p) + a for p, a in zip(prompts, answers)], -100, "right")
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 4))
    model.eval()
    return losses


def prepare(
    task: str,
    steps: int,
    workdir: Path,
    warm_start_steps: int = 0,
    lr: float | None = None,
    seed: int | None = None,
    model_seed: int | None = None,
) -> dict[str, Any]:
    """The task's spec with its initial model, tokenizer and prompts written under ``workdir``.

    ``warm_start_steps`` > 0: the model first takes that many :func:`warm_start` steps.
    ``lr``, ``seed``: both trainers' learning rate and seed instead of the task's.
    ``model_seed``: the initial model's and its warm start's seed instead of ``seed``.
    """
    from rlflow.data.tasks import ArithmeticTask
    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.data.tokenizer import build_char_tokenizer

    spec = {**TASKS[task], "name": task, "steps": steps}
    if lr is not None:
        spec["lr"] = lr
    if seed is not None:
        spec["seed"] = seed
    spec["model_seed"] = spec["seed"] if model_seed is None else model_seed
    model_dir = workdir / "model"
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        family="llama",
        vocab_size=len(tokenizer),
        hidden_size=spec["hidden_size"],
        num_layers=spec["num_layers"],
        num_heads=spec["num_heads"],
        num_kv_heads=spec["num_kv_heads"],
        intermediate_size=spec["intermediate_size"],
        tie_word_embeddings=spec["tie_word_embeddings"],
        seed=spec["model_seed"],
    )
    arithmetic = ArithmeticTask(spec["num_digits"], tuple(spec["ops"]), spec["reverse_answer"], seed=spec["seed"])
    if warm_start_steps:  # on the model seed's task: one warm start for every run seed
        warm_task = ArithmeticTask(
            spec["num_digits"], tuple(spec["ops"]), spec["reverse_answer"], seed=spec["model_seed"]
        )
        losses = warm_start(model, tokenizer, warm_task, warm_start_steps, seed=spec["model_seed"])
        spec["warm_start"] = {
            "sft_steps": warm_start_steps,
            "model_seed": spec["model_seed"],
            "loss_first": losses[0],
            "loss_last": losses[-1],
        }
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts = workdir / "prompts.jsonl"
    with prompts.open("w") as f:
        for example in arithmetic.sample("train", NUM_PROMPTS_FILE, seed=spec["seed"]):
            f.write(json.dumps({"prompt": example.prompt, "ground_truth": example.ground_truth}) + "\n")
    return {**spec, "model_dir": str(model_dir), "prompts_file": str(prompts)}


def policy_lag_refusal(spec: dict[str, Any]) -> str | None:
    """None when rlflow's config accepts ``algorithm.policy_lag: 1`` for ``spec``, else the config's error."""
    from rlflow.trainer.config import ConfigError, load_config

    try:
        load_config(rlflow_config(spec, tempfile.gettempdir(), policy_lag=1))
    except ConfigError as err:
        return str(err)
    return None


def run_side(side: str, spec: dict[str, Any], threads: int, workdir: Path, label: str, **extra: Any) -> dict:
    """Runs one trainer on ``spec`` in a fresh process; returns its summary and versions.

    Args:
        side: ``"trl"`` or ``"rlflow"``.
        spec: the prepared task spec.
        threads: torch threads of the process (``OMP_NUM_THREADS`` too).
        workdir: where the run's spec, events, log and output go.
        label: the run's name in records and file names.
        extra: more spec keys (``policy_lag``).
    """
    run_dir = workdir / label
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = {**spec, **extra, "threads": threads, "output_dir": str(run_dir / "out")}
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    python = trl_python() if side == "trl" else Path(sys.executable)
    script = ROOT / "benchmarks" / ("trl_grpo.py" if side == "trl" else "rlflow_grpo.py")
    events_path = run_dir / "events.jsonl"
    load = os.getloadavg()
    spawned_at = run_script(python, script, [run_dir / "spec.json", events_path], run_dir / "log.txt", threads, label)
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    figures = summarize(events, spawned_at)
    versions = next((e for e in events if e["event"] == "versions"), {})
    startup = next((e for e in events if e["event"] == "startup"), None)
    figures["versions"] = {k: v for k, v in versions.items() if k != "event"}
    if startup is not None:
        figures["rlflow_startup"] = {k: v for k, v in startup.items() if k != "event"}
    calls = [e["calls"] for e in events if e["event"] == "step" and e.get("calls")][1:]  # step 1 not timed
    if calls:
        names = sorted(set().union(*calls))
        figures["call_s_median"] = {n: round(_median([c[n] for c in calls if n in c]), 4) for n in names}
    for kind in ("plan", "precision"):
        found = next((e for e in events if e["event"] == kind), None)
        if found is not None:
            figures[kind] = {k: v for k, v in found.items() if k != "event"}
    figures["load_average_1m_before"] = round(load[0], 2)
    figures["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    return figures


def run_script(python: Path, script: Path, args: list, log_path: Path, threads: int, label: str) -> float:
    """``script`` with ``args`` under ``python`` in a fresh process of ``threads`` torch threads, its
    output in ``log_path``; the wall time it was spawned at. Raises RuntimeError with the log's tail
    when it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.pop("PYTHONPATH", None)  # TRL's venv must not see this venv's packages
    with log_path.open("w") as log:
        spawned_at = time.time()
        proc = subprocess.run(
            [str(python), str(script), *map(str, args)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=RUN_TIMEOUT_S,
        )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{label}: {script.name} exited {proc.returncode}; log {log_path}:\n{log_path.read_text()[-3000:]}"
        )
    return spawned_at


# ----------------------------------------------------------------------------- records


def _quarter_mean(values: list[float], last: bool) -> float:
    n = max(1, len(values) // 4)
    part = values[-n:] if last else values[:n]
    return round(sum(part) / len(part), 4)


def _run_record(task: str, label: str, figures: dict) -> dict:
    rewards = figures["rewards"]
    record = {"name": f"trl_{task}_{label}", "task": task, "trainer": label}
    record.update({k: v for k, v in figures.items() if k not in ("rewards", "samples")})
    record["reward_first_quarter"] = _quarter_mean(rewards, last=False)
    record["reward_last_quarter"] = _quarter_mean(rewards, last=True)
    record["samples_seen"] = figures["samples"][-1]
    record["units"] = {
        "completions_per_s": "completions sampled / wall s from the end of step 1 to the end of the last step",
        "step_s": "wall s between consecutive step ends",
        "startup": "wall s from process start to the first step's start / end",
        "reward": "mean numeric_match reward of a quarter of the steps' completions",
    }
    return record


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _commit() -> str | None:
    """This checkout's commit, with ``+dirty`` when files differ from it (other work in the tree)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def task_record(task: str, spec: dict, runs: dict[str, list[dict]], notes: list[str], plot: str | None) -> dict:
    """One task's comparison: medians over repeats, TRL's faster thread count, rlflow / TRL ratios."""
    cps = {label: _median([r["completions_per_s"] for r in rs]) for label, rs in runs.items()}
    first = {label: _median([r["startup_first_step_done_s"] for r in rs]) for label, rs in runs.items()}
    trl_labels = [label for label in cps if label.startswith("trl")]
    best_trl = max(trl_labels, key=cps.get)
    record = {
        "name": f"trl_{task}_summary",
        "task": task,
        "steps": spec["steps"],
        "completions_per_step": spec["num_prompts"] * spec["n_samples"],
        "warm_start": spec.get("warm_start"),
        "repeats": len(next(iter(runs.values()))),
        "completions_per_s": {label: round(v, 2) for label, v in cps.items()},
        "trl_best": best_trl,
    }
    for label in cps:
        if label.startswith("rlflow"):
            record[f"ratio_{label}"] = round(cps[label] / cps[best_trl], 3)
            record[f"startup_gap_s_{label}"] = round(first[label] - first[best_trl], 2)
    record["reward_last_quarter"] = {
        label: _median([_quarter_mean(r["rewards"], last=True) for r in rs]) for label, rs in runs.items()
    }
    record["versions"] = {label: rs[0]["versions"] for label, rs in runs.items()}
    record["load_average_1m"] = sorted(
        {r[k] for rs in runs.values() for r in rs for k in ("load_average_1m_before", "load_average_1m_after")}
    )
    record["rlflow_commit"] = _commit()
    record["notes"] = notes
    record["plot"] = plot
    record["units"] = {"ratio": "rlflow completions/s / TRL's faster completions/s (medians over repeats)"}
    return record


def machine_peaks() -> dict[str, float]:
    """This machine's limits (benchmarks/bench_precision.py's measurements): the 2048² matmul's
    FLOP/s on both cores in fp32 and, where the CPU multiplies bf16 natively, in bf16 (elsewhere
    nothing computes in bf16: capped at AVX2, oneDNN's bf16 matmul falls to reference kernels that
    take seconds per 2048² product), and the copy bandwidth (bytes/s) of one thread and of two."""
    import torch

    from benchmarks.bench_precision import _copy_bytes_per_s, _matmul_flops
    from rlflow.engine.parallelize import cpu_computes_bf16

    precisions = (("fp32", torch.float32), ("bf16", torch.bfloat16))[: 2 if cpu_computes_bf16() else 1]
    threads = torch.get_num_threads()
    try:
        peaks = {f"matmul_flops_{p}": _matmul_flops(d, 2) for p, d in precisions}
        peaks["copy_bytes_per_s_1thread"] = _copy_bytes_per_s()
        peaks["copy_bytes_per_s_2threads"] = _copy_bytes_per_s(threads=2)
    finally:
        torch.set_num_threads(threads)
    return peaks


def limits_record(
    task: str, spec: dict, figures: dict, peaks: dict[str, float], trl_completions_per_s: float | None = None
) -> dict | None:
    """rlflow's actor calls on a fixed-length task against the machine's limits, or None (lengths vary).

    FLOPs count the matmuls (layers' projections and the LM head) of every row's prompt
    (``max_prompt_len`` tokens, an upper bound) and response: ``2·N`` per token for generation and
    inference, ``6·N`` for a training step. A decode step reads every generation worker's
    weights and the KV cache of its rows (at the mean context); its seconds are the generation
    call's over the new tokens (prefill included, so an upper bound).

    ``at_limits``: the step of the same calls at the limits — each call's matmuls at the peak, a
    decode step the longer of its matmuls at the peak and one copy of the weights and the cache
    read at two threads' copy bandwidth — against rlflow's step (its completions/s) and, given
    ``trl_completions_per_s``, TRL's: ``max_ratio_to_trl`` is the ratio no implementation of these
    calls passes on this machine.
    """
    if spec.get("min_new_tokens", 0) != spec["max_new_tokens"] or "call_s_median" not in figures:
        return None
    config = json.loads((Path(spec["model_dir"]) / "config.json").read_text())
    h, layers, mlp, vocab = (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["intermediate_size"],
        config["vocab_size"],
    )
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    n_matmul = layers * (2 * h * h + 2 * h * kv + 3 * h * mlp) + vocab * h
    rows, new = spec["num_prompts"] * spec["n_samples"], spec["max_new_tokens"]
    tokens = rows * (spec["max_prompt_len"] + new)
    precision = figures.get("precision", {}).get("actor", "float32")
    peak = peaks["matmul_flops_bf16" if precision == "bfloat16" else "matmul_flops_fp32"]
    itemsize = 2 if precision == "bfloat16" else 4
    plan = figures.get("plan", {}).get("calls", {})
    record = {"name": f"trl_{task}_limits", "task": task, "precision": precision, "plan": plan, "calls": {}}
    cache = 2 * layers * kv * itemsize * rows * (spec["max_prompt_len"] + new / 2)
    limit_s = 0.0
    for call, seconds in figures["call_s_median"].items():
        per_token = 6 if call.endswith("_train") else 2 if call.endswith(("_gen", "_inf")) else None
        if not call.startswith("actor_") or per_token is None or seconds <= 0:  # the actor's calls only
            continue
        flops = per_token * n_matmul * tokens
        entry = {"seconds": seconds, "gflop": round(flops / 1e9, 1), "gflop_per_s": round(flops / seconds / 1e9, 1)}
        entry["share_of_matmul_peak_2threads"] = round(flops / seconds / peak, 3)
        if call.endswith("_gen"):
            weights_once = (n_matmul + (0 if config.get("tie_word_embeddings") else vocab * h)) * itemsize
            limit_s += 2 * n_matmul * rows * spec["max_prompt_len"] / peak  # the prefill
            limit_s += new * max(
                2 * n_matmul * rows / peak, (weights_once + cache) / peaks["copy_bytes_per_s_2threads"]
            )
            step_bytes = weights_once * _dp_of(plan.get(call, "")) + cache  # each generation worker reads its copy
            step_s = seconds / new
            entry.update(
                decode_step_ms=round(step_s * 1e3, 3),
                decode_bytes_per_step=int(step_bytes),
                decode_gb_per_s=round(step_bytes / step_s / 1e9, 2),
                share_of_copy_bandwidth_1thread=round(step_bytes / step_s / peaks["copy_bytes_per_s_1thread"], 3),
                share_of_copy_bandwidth_2threads=round(step_bytes / step_s / peaks["copy_bytes_per_s_2threads"], 3),
            )
        else:
            limit_s += flops / peak
        record["calls"][call] = entry
    at_limits = {"step_s": round(limit_s, 3)}
    if figures.get("completions_per_s"):
        at_limits["rlflow_step_s"] = round(rows / figures["completions_per_s"], 3)
        at_limits["share_of_rlflow_step"] = round(limit_s * figures["completions_per_s"] / rows, 3)
    if trl_completions_per_s:
        at_limits["trl_step_s"] = round(rows / trl_completions_per_s, 3)
        at_limits["max_ratio_to_trl"] = round(rows / trl_completions_per_s / limit_s, 2)
    record["at_limits"] = at_limits
    record["peaks"] = {
        "matmul_gflop_per_s_2threads": {
            p: round(peaks[f"matmul_flops_{p}"] / 1e9, 1) for p in ("fp32", "bf16") if f"matmul_flops_{p}" in peaks
        },
        "copy_gb_per_s_1thread": round(peaks["copy_bytes_per_s_1thread"] / 1e9, 1),
        "copy_gb_per_s_2threads": round(peaks["copy_bytes_per_s_2threads"] / 1e9, 1),
    }
    record["units"] = {
        "share": "achieved / measured limit; FLOPs of the matmuls only (limits_record)",
        "at_limits": "seconds of a step whose actor calls run at the measured limits (limits_record)",
    }
    return record


def _dp_of(strategy: str) -> int:
    """The dp degree of a strategy's text (``(dp=2,tp=1,pp=1)``); 1 when absent."""
    for part in strategy.strip("()").split(","):
        key, _, value = part.partition("=")
        if key.strip() == "dp" and value.strip().isdigit():
            return int(value)
    return 1


def plot_rewards(task: str, runs: dict[str, list[dict]], path: Path) -> None:
    """Reward per step against samples seen, each run smoothed over a tenth of its steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rs in runs.items():
        for i, r in enumerate(rs):
            window = max(1, len(r["rewards"]) // 10)
            ax.plot(r["samples"], smooth(r["rewards"], window), label=label if i == 0 else None, alpha=0.85)
    ax.set_xlabel("completions sampled")
    ax.set_ylabel(f"mean reward (moving average, {max(1, len(r['rewards']) // 10)} steps)")
    ax.set_title(f"GRPO, task {task!r}: rlflow vs TRL GRPOTrainer")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the benchmark


def _env_trl_threads() -> list[int]:
    raw = os.environ.get("RLFLOW_BENCH_TRL_THREADS", "1,2")
    try:
        threads = [int(t) for t in raw.split(",") if t.strip()]
    except ValueError:
        threads = []
    if not threads or any(t < 1 for t in threads):
        raise ValueError(f"RLFLOW_BENCH_TRL_THREADS={raw!r}: expected torch thread counts such as 1,2")
    return threads


def _env_trl_precisions() -> list[str]:
    raw = os.environ.get("RLFLOW_BENCH_TRL_PRECISIONS", "fp32,bf16")
    precisions = [p.strip() for p in raw.split(",") if p.strip()]
    if not precisions or any(p not in ("fp32", "bf16") for p in precisions):
        raise ValueError(f"RLFLOW_BENCH_TRL_PRECISIONS={raw!r}: expected fp32, bf16 or both")
    return precisions


def _variants(
    spec: dict, trl_threads: list[int], trl_precisions: list[str] = ("fp32", "bf16")
) -> tuple[list[tuple[str, str, int, dict]], list[str]]:  # fmt: skip
    """``(label, side, threads, extra spec)`` of each run of a task, interleaved in this order."""
    trl = [
        (f"trl_{t}thread{'s' if t > 1 else ''}{'' if p == 'fp32' else '_' + p}", "trl", t, {"precision": p})
        for p in trl_precisions
        for t in trl_threads
    ]
    # rlflow_again: the default setup's second run of the task's shape, which plans with the profile the
    # first run calibrated by its own calls (placement.calibrate: run) and so calibrates no more
    variants = [*trl[:1], ("rlflow", "rlflow", 1, {}), *trl[1:], ("rlflow_again", "rlflow", 1, {})]
    refusal = policy_lag_refusal(spec)
    notes = []
    if trl_threads != [1, 2]:
        notes.append(f"TRL ran with {trl_threads} torch threads (RLFLOW_BENCH_TRL_THREADS), not with 1 and 2")
    if list(trl_precisions) != ["fp32", "bf16"]:
        notes.append(f"TRL ran in {list(trl_precisions)} (RLFLOW_BENCH_TRL_PRECISIONS), not in fp32 and bf16")
    if refusal is None:
        variants.append(("rlflow_lag1", "rlflow", 1, {"policy_lag": 1}))
    else:
        notes.append(f"rlflow_lag1 skipped: the config refuses algorithm.policy_lag=1: {refusal}")
    return variants, notes


def run(tasks: list[str] | None = None, steps: dict[str, int] | None = None, repeats: int | None = None) -> list[dict]:
    """One record per run and one per task; arguments override the environment variables."""
    tasks = tasks or _env_tasks()
    steps = steps or {}
    repeats = repeats or _env_int("RLFLOW_BENCH_TRL_REPEATS", 1)
    out = Path(os.environ.get("RLFLOW_BENCH_TRL_OUT", ROOT / "outputs" / "bench_trl"))
    out.mkdir(parents=True, exist_ok=True)
    trl_threads, trl_precisions = _env_trl_threads(), _env_trl_precisions()
    trl_python()  # before any timing: the first call may install
    fixed_length = [t for t in tasks if TASKS[t].get("min_new_tokens", 0) == TASKS[t]["max_new_tokens"]]
    peaks = machine_peaks() if fixed_length else {}
    records = []
    for task in tasks:
        # the figures need 2 steps: the first one is not timed
        n_steps = steps.get(task) or _env_int(f"RLFLOW_BENCH_TRL_{task.upper()}_STEPS", TASKS[task]["steps"], 2)
        workdir = out / task
        workdir.mkdir(exist_ok=True)
        lr = os.environ.get("RLFLOW_BENCH_TRL_LR")
        spec = prepare(
            task,
            n_steps,
            workdir,
            _env_int("RLFLOW_BENCH_TRL_WARM_START_STEPS", 0, minimum=0),
            lr=None if lr is None else float(lr),
            seed=_env_int("RLFLOW_BENCH_TRL_SEED", TASKS[task]["seed"], minimum=0),
            model_seed=_env_int("RLFLOW_BENCH_TRL_MODEL_SEED", None, minimum=0),  # type: ignore[arg-type]
        )
        variants, notes = _variants(spec, trl_threads, trl_precisions)
        runs: dict[str, list[dict]] = {label: [] for label, *_ in variants}
        for repeat in range(repeats):
            for label, side, threads, extra in variants:
                figures = run_side(side, spec, threads, workdir, f"{label}_r{repeat}", **extra)
                runs[label].append(figures)
                records.append({**_run_record(task, label, figures), "repeat": repeat})
                print(f"# {task} {label} r{repeat}: {figures['completions_per_s']} completions/s", file=sys.stderr)
        (workdir / "curves.json").write_text(
            json.dumps(
                {label: [{"samples": r["samples"], "rewards": r["rewards"]} for r in rs] for label, rs in runs.items()}
            )
        )
        plot = out / f"reward_vs_samples_{task}.png"
        plot_rewards(task, runs, plot)
        records.append(task_record(task, spec, runs, notes, str(plot)))
        if task in fixed_length:
            steady = runs.get("rlflow_again") or runs["rlflow"]  # calibrated: its calls on one thread count
            summary = records[-1]
            trl_cps = summary["completions_per_s"][summary["trl_best"]]
            limits = limits_record(task, spec, steady[-1], peaks, trl_completions_per_s=trl_cps)
            if limits is not None:
                records.append(limits)
    return records


if __name__ == "__main__":
    for record in run():
        print(json.dumps(record))
