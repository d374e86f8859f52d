"""The ``models`` sections of an rlflow config: where each model's weights come from, how it
trains, and its LoRA adapters (re-exported by :mod:`rlflow.trainer.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.engine.lora import PUSH_MODES
from rlflow.engine.optim import OptimConfig
from rlflow.families import list_families
from rlflow.trainer.config_fields import ConfigError, _f, _Section

__all__ = ["MODEL_ROLES", "LoraConfig", "ModelConfig"]

MODEL_ROLES = ("actor", "ref", "critic", "reward", "teacher")


@dataclass(kw_only=True)
class LoraConfig(_Section):
    """Low-rank adapters (LoRA, with peft) on the actor's linear modules; only they train.

    The rollout samples from the merged weights; checkpoints and the final export hold the adapter
    in PEFT's format (``adapter/``) beside the merged model."""

    r: int = _f(8, "rank of the adapters", ge=1)
    alpha: float = _f(16.0, "scaling numerator: the weight update is (alpha / r) * B @ A", gt=0.0)
    dropout: float = _f(0.0, "dropout on the adapters' input in training", ge=0.0, lt=1.0)
    target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        "names of the linear modules of the decoder layers to adapt (the last part of their module paths)",
    )
    push: str = _f(
        "adapters",
        "what a copy kept between calls (the rollout's) gets after its first push: adapters: lora_A and lora_B, "
        "merged on the copy, which keeps the base of the adapted weights in float32; merged: the merged adapted "
        "weights (more bytes a push, no base kept on the copy)",
        choices=PUSH_MODES,
    )

    def _check(self) -> None:
        if not self.target_modules:
            raise ConfigError("target_modules", "is empty; name at least one linear module (e.g. [q_proj, v_proj])")


@dataclass(kw_only=True)
class ModelConfig(_Section):
    """One model (actor, ref, critic, reward or teacher): where its weights come from and how it trains."""

    init: str = _f("tiny", "weights: a local HF dir, a fresh tiny model, or a copy", choices=("path", "tiny", "copy"))
    path: str | None = _f(
        None, "local Hugging Face model directory, or a Hub id resolved through the HF cache (init: path)"
    )
    init_from: str | None = _f(
        None,
        "init: copy: start from this model's weights as RL starts (after the warm-up); a critic "
        "copies the backbone and keeps its fresh value head",
        choices=MODEL_ROLES,
    )
    family: str = _f("llama", "tiny model architecture", choices=tuple(list_families()))
    hidden_size: int = _f(128, "tiny model: hidden size", ge=1)
    num_layers: int = _f(4, "tiny model: decoder layers", ge=1)
    num_heads: int = _f(4, "tiny model: attention heads", ge=1)
    num_kv_heads: int = _f(4, "tiny model: key/value heads (grouped-query attention)", ge=1)
    intermediate_size: int = _f(512, "tiny model: MLP width", ge=1)
    tie_word_embeddings: bool = _f(True, "tiny model: share the embedding and LM-head weights")
    dtype: str = _f(
        "auto",
        "compute precision of its training, inference and generation (master weights and optimizer state stay "
        "float32); auto: bfloat16 on GPUs, and on CPUs with avx512_bf16 or amx_bf16 whose bf16 matmul measures "
        "1.25x fp32's or faster, where a decoder layer's "
        "multiplying parameters times a training pass's tokens reach 2^28; else float32",
        choices=("auto", "float32", "bfloat16"),
    )
    trainable: bool | None = _f(None, "null: actor and critic train (and reward under rm); ref and teacher never train")
    lr: float = _f(1e-5, "peak learning rate", gt=0.0)
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay", ge=0.0)
    betas: tuple[float, float] = _f((0.9, 0.999), "AdamW betas")
    eps: float = _f(1e-8, "AdamW epsilon", gt=0.0)
    warmup_steps: int = _f(0, "optimizer steps of linear learning-rate warm-up", ge=0)
    lr_schedule: str = _f("constant", "learning rate after warm-up", choices=("constant", "cosine"))
    min_lr_ratio: float = _f(0.0, "cosine floor as a fraction of lr", ge=0.0, le=1.0)
    grad_clip: float | None = _f(1.0, "clip the global gradient norm to this; null: off", gt=0.0)
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    shared_prefix: bool = _f(
        True,
        "training and inference forwards run the rows that share a prompt (the n samples of a prompt) as one "
        "sequence per prompt, the prompt once, where that is estimated cheaper (not with packing, pp > 1, sliding "
        "window attention or a router loss); false: padded rows always",
    )
    micro_batch_tokens: int | None = _f(None, "tokens per forward/backward micro-batch; null: whole batch", ge=1)
    fused_cpu_ops: bool = _f(
        True,
        "on a CPU, Llama-style RMSNorms, SwiGLU MLPs and RoPE run forward and backward as one fused C++ pass "
        "each, and causal attention over whole sequences as one C++ kernel (float32, outside autocast; "
        "rlflow.engine.fused_ops; the RoPE function is replaced for the whole worker process); false: the "
        "model's own modules and HF's SDPA",
    )
    lora: LoraConfig | None = _f(
        None, "train low-rank adapters instead of every weight (actor only, tp = pp = 1); null: full-parameter"
    )
    router_aux_loss_coef: float | None = _f(
        None,
        "mixture-of-experts models: the training loss adds this times the router's load-balancing loss (HF's, "
        "logged as router_aux_loss; pp = 1); null: the model config's router_aux_loss_coef; 0: off",
        ge=0.0,
    )

    def _check(self) -> None:
        if (self.init == "path") != (self.path is not None):
            raise ConfigError("path", f"init={self.init!r} needs path {'set' if self.init == 'path' else 'null'}")
        if (self.init == "copy") != (self.init_from is not None):
            raise ConfigError(
                "init_from", f"init={self.init!r} needs init_from {'set' if self.init == 'copy' else 'null'}"
            )
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("betas", f"{list(self.betas)} must be two values in [0, 1)")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if self.init == "tiny":
            if self.hidden_size % self.num_heads:
                raise ConfigError("num_heads", f"{self.num_heads} does not divide hidden_size={self.hidden_size}")
            if self.num_heads % self.num_kv_heads:
                raise ConfigError("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")

    def optim_config(self, total_steps: int | None) -> OptimConfig:
        """The engine's :class:`OptimConfig`; ``total_steps`` (optimizer steps) ends the cosine."""
        return OptimConfig(
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            warmup_steps=self.warmup_steps,
            total_steps=total_steps if self.lr_schedule == "cosine" else None,
            min_lr_ratio=self.min_lr_ratio,
            max_grad_norm=self.grad_clip,
        )
