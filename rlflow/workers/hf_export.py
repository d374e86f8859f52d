"""What makes an HF export of a trained model usable on its own: the run's tokenizer and a generation config.

The training engine writes ``config.json`` and the weights (:meth:`TrainEngine.save_pretrained`);
:func:`complete_hf_export` adds the run's tokenizer (``AutoTokenizer.from_pretrained(export)``
then works) and, for a causal LM, a ``generation_config.json`` holding the tokenizer's special
ids and the run's rollout sampling, so ``model.generate(**tokenizer(text, return_tensors="pt"))``
samples as the run sampled, out of the box.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, GenerationConfig

from rlflow.data.tokenizer import load_tokenizer
from rlflow.engine.rollout.base import SamplingParams

__all__ = ["complete_hf_export", "generation_config"]


def complete_hf_export(path: str | Path, tokenizer_path: str | Path, sampling: SamplingParams | None = None) -> None:
    """Save the tokenizer at ``tokenizer_path`` into the HF export ``path``, and a generation config
    when the export is a causal LM.

    Args:
        path: an HF export (``config.json`` and weights).
        tokenizer_path: the run's tokenizer directory.
        sampling: the run's rollout sampling, the export's generation defaults; None: HF's.
    """
    tokenizer = load_tokenizer(str(tokenizer_path))  # a tokenizer without a pad token gets EOS, as training padded
    tokenizer.save_pretrained(path)
    architectures = AutoConfig.from_pretrained(path, local_files_only=True).architectures or []
    # Value and reward models (token or sequence classification heads) do not generate.
    if any(name.endswith("ForCausalLM") for name in architectures):
        generation_config(path, tokenizer, sampling).save_pretrained(path)


def generation_config(path: str | Path, tokenizer, sampling: SamplingParams | None = None) -> GenerationConfig:
    """The export's generation config (the one the engine wrote, else the model config's) with the
    tokenizer's bos/eos/pad ids and ``sampling``'s temperature, top-p, top-k and ``max_new_tokens``.

    A greedy ``sampling`` gives ``do_sample=False``; rlflow's ``top_k=0`` (off) is written as
    such, since HF's default would be 50.
    """
    path = Path(path)
    if (path / "generation_config.json").is_file():
        config = GenerationConfig.from_pretrained(path, local_files_only=True)
    else:
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path, local_files_only=True))
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config.update(**{key: value for key, value in ids.items() if value is not None})
    if sampling is not None:
        config.update(max_new_tokens=sampling.max_new_tokens, do_sample=not sampling.greedy)
        if sampling.greedy:
            config.update(temperature=None, top_p=None, top_k=None)
        else:
            config.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        # A rollout ended at any of its stop tokens: generation ends there too.
        stops = list(dict.fromkeys(t for t in (tokenizer.eos_token_id, *sampling.stop_token_ids) if t is not None))
        if stops:
            config.update(eos_token_id=stops[0] if len(stops) == 1 else stops)
    return config
