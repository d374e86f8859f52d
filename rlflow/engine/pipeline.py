"""Pipeline stages of an HF decoder and the torch pipelining schedules that run them.

A decoder is the item sequence ``embed, layer.0 … layer.{L-1}, norm, head`` and
:func:`rlflow.parallel.layout.pipeline_stages` cuts it into ``pp`` contiguous stages
balanced by parameter count — the same function the reshard planner reads, so a stage here
holds exactly the parameters the layout says it holds.

:class:`DecoderStage` is one stage as a plain ``nn.Module`` that keeps the HF module paths of
the model's family (:mod:`rlflow.families`: ``model.embed_tokens``, ``model.layers.<i>``,
``model.norm``, ``lm_head`` / ``score`` for the Llama-style families; the layers sit in a
``ModuleDict`` keyed by their global index), so state-dict keys, the TP plan and the layouts
all use HF names. With ``pp == 1`` the single stage is the whole model, and
the engine runs that same module without a schedule: one forward path for every strategy.

Every stage computes its own rotary embeddings and attention mask from ``position_ids`` and
``attention_mask``, which the schedule hands to all stages as keyword arguments, so only
the hidden states travel between stages.

A stage also runs packed rows (``pp == 1`` only, see the engine): one row of sequences laid
end to end, described by ``cu_seqlens`` and ``max_seqlen``, which go to every attention call
as HF's varlen keyword arguments (:mod:`rlflow.engine.attention`); no mask is built.

Tied embeddings: the first stage holds ``embed_tokens`` and the last stage ``lm_head``; with
``pp > 1`` they are two copies of one tensor, initialised equal. After every backward the
engine all-reduces (sums) the two copies' gradients between the first and last stage
(:func:`tied_embedding_group`), so both take the same optimizer step — the gradient a
single tied tensor would get — and stay equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from rlflow.engine.attention import check_varlen_implementation, varlen_kwargs
from rlflow.engine.models import cache_kwarg
from rlflow.engine.shared_prefix import SharedPrefix
from rlflow.families import family_of
from rlflow.parallel.layout import pipeline_items, pipeline_stages

__all__ = [
    "DecoderStage",
    "build_schedule",
    "build_stage",
    "head_kind",
    "stage_forward_mismatch",
    "tied_embedding_group",
    "token_log_probs",
]


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at dotted ``path`` under ``root``, creating plain parent modules."""
    *parents, leaf = path.split(".")
    for name in parents:
        if not hasattr(root, name):
            root.add_module(name, nn.Module())
        root = getattr(root, name)
    root.add_module(leaf, module)


def head_kind(model: nn.Module) -> str:
    """``"lm"`` for a ``*ForCausalLM`` model, ``"value"`` for a scalar-head ``*ForTokenClassification``."""
    family = family_of(model.config)
    if _submodule(model, family.lm_head_module) is not None:
        return "lm"
    score = _submodule(model, family.value_head_module)
    if isinstance(score, nn.Linear):
        if score.out_features != 1:
            raise ValueError(
                f"a value head must have one output, got {family.value_head_module}.out_features={score.out_features}"
            )
        return "value"
    raise ValueError(
        f"{type(model).__name__} has neither `{family.lm_head_module}` nor a scalar `{family.value_head_module}` head"
    )


def token_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, *, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the given tokens and entropies of the predicted distributions.

    Position ``t`` holds ``log p(input_ids[t] | input_ids[<t])`` and the entropy of that
    distribution; positions that start a sequence or are padding (``position_ids == 0``) hold 0.

    Args:
        logits: ``(B, T, V)`` next-token logits (``logits[:, t]`` predicts token ``t + 1``).
        input_ids: ``(B, T)`` token ids.
        position_ids: ``(B, T)`` positions inside each sequence.
        with_entropy: compute the entropies (else zeros).

    Returns:
        ``(log_probs, entropy)``, both ``(B, T)`` float32.
    """
    # float32: log-softmax over a large vocabulary loses precision in bf16.
    pred = logits[:, :-1].float()
    lse = torch.logsumexp(pred, dim=-1)
    picked = pred.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    log_probs = nn.functional.pad(picked - lse, (1, 0))
    if with_entropy:
        entropy = nn.functional.pad(lse - (torch.softmax(pred, dim=-1) * pred).sum(-1), (1, 0))
    else:
        entropy = torch.zeros_like(log_probs)
    valid = position_ids > 0
    return log_probs * valid, entropy * valid


class DecoderStage(nn.Module):
    """One pipeline stage of an HF decoder of a registered family (see the module docstring).

    Forward contract (``B`` rows, ``T`` tokens, ``H`` hidden size):

    * input ``x``: ``(B, T)`` token ids on the first stage, ``(B, T, H)`` hidden states else;
      keyword ``attention_mask`` ``(B, T)`` and ``position_ids`` ``(B, T)``; on an LM's last
      stage optionally ``labels`` ``(B, T)``.
    * a packed row instead: ``B == 1``, ``attention_mask=None``, ``position_ids`` restarting
      at 0 for each sequence, and ``cu_seqlens`` ``(S + 1,)`` int32 with ``max_seqlen`` (int)
      for its ``S`` sequences; the model must use a varlen attention implementation.
    * output: ``(B, T, H)`` hidden states, except on the last stage: values ``(B, T)`` for a
      value head; for an LM head the logits ``(B, T, V)``, or with ``labels`` the tuple
      ``(log_probs, entropy[, logits])`` of :func:`token_log_probs` (logits when
      ``return_logits``).
    """

    def __init__(self, hf_model: nn.Module, items: Sequence[str]) -> None:
        super().__init__()
        self.config = hf_model.config
        self.family = family_of(self.config)
        self.items = list(items)
        self.kind = head_kind(hf_model)
        self.is_first = "embed" in self.items
        self.is_last = "head" in self.items
        self.return_logits = True
        self.compute_entropy = True
        self.layer_types = self.family.layer_types(self.config)
        family = self.family
        if self.is_first:
            _attach(self, family.embed_module, hf_model.get_submodule(family.embed_module))
        layers = hf_model.get_submodule(family.layers_module)
        indices = [int(item.split(".")[1]) for item in self.items if item.startswith("layer.")]
        _attach(self, family.layers_module, nn.ModuleDict({str(i): layers[i] for i in indices}))
        if "norm" in self.items:
            _attach(self, family.norm_module, hf_model.get_submodule(family.norm_module))
        _attach(self, family.rotary_module, hf_model.get_submodule(family.rotary_module))
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False)) and self.kind == "lm"
        if self.is_last and self.kind == "lm":
            head = hf_model.get_submodule(family.lm_head_module)
            _attach(self, family.lm_head_module, head)
            if self.tied and not self.is_first:
                # The last stage's own copy of the tied embedding (kept equal by the engine).
                head.weight = nn.Parameter(head.weight.detach().clone())
        elif self.is_last:
            # The classifier dropout is not applied: RL needs a deterministic head.
            _attach(self, family.value_head_module, hf_model.get_submodule(family.value_head_module))

    def _masks(self, hidden: torch.Tensor, attention_mask, position_ids) -> dict[str, torch.Tensor | None]:
        kwargs = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
        )
        kwargs[cache_kwarg(create_causal_mask)] = None  # no KV cache: whole sequences
        masks = {}
        if "full_attention" in self.layer_types:
            masks["full_attention"] = create_causal_mask(**kwargs)
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    def _tree_mask(self, shared_prefix: SharedPrefix, dtype: torch.dtype) -> torch.Tensor:
        """The groups' 4-D mask as the attention implementation takes it: boolean for SDPA, additive
        (0 or the dtype's minimum) for eager attention."""
        if self.config._attn_implementation != "eager":
            return shared_prefix.mask
        return torch.zeros(shared_prefix.mask.shape, dtype=dtype, device=shared_prefix.mask.device).masked_fill(
            ~shared_prefix.mask, torch.finfo(dtype).min
        )

    def _packed_kwargs(self, attention_mask, cu_seqlens, max_seqlen) -> dict:
        """The varlen keyword arguments of every layer for a packed row."""
        if attention_mask is not None or max_seqlen is None:
            raise ValueError("a packed row (cu_seqlens given) needs attention_mask=None and max_seqlen")
        check_varlen_implementation(self.config._attn_implementation)
        return varlen_kwargs(cu_seqlens, max_seqlen)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        shared_prefix: SharedPrefix | None = None,
    ):
        if position_ids is None:
            raise ValueError("DecoderStage.forward needs position_ids (B, T)")
        family = self.family
        hidden = self.get_submodule(family.embed_module)(x) if self.is_first else x
        layers = self.get_submodule(family.layers_module)
        rows, width = hidden.shape[:2]
        layer_positions = position_ids
        if shared_prefix is not None:  # one sequence per prompt (rlflow.engine.shared_prefix)
            hidden, layer_positions = shared_prefix.pack(hidden), shared_prefix.position_ids
        if len(layers):
            position_embeddings = self.get_submodule(family.rotary_module)(hidden, layer_positions)
            if shared_prefix is not None:
                masks, extra = dict.fromkeys(self.layer_types, self._tree_mask(shared_prefix, hidden.dtype)), {}
            elif cu_seqlens is None:
                masks, extra = self._masks(hidden, attention_mask, position_ids), {}
            else:  # the varlen kernel keeps each sequence to itself: no mask
                masks, extra = {}, self._packed_kwargs(attention_mask, cu_seqlens, max_seqlen)
            for key, layer in layers.items():
                hidden = layer(
                    hidden,
                    attention_mask=masks.get(self.layer_types[int(key)]),
                    position_embeddings=position_embeddings,
                    position_ids=layer_positions,
                    **extra,
                )
        if shared_prefix is not None:
            hidden = shared_prefix.unpack(hidden, rows, width)
        if not self.is_last:
            return hidden
        if "norm" in self.items:
            hidden = self.get_submodule(family.norm_module)(hidden)
        if self.kind == "value":
            # (B, T, 1) -> (B, T) fp32 as a new tensor: `squeeze` would return a view of the
            # head's output, and FSDP2 hooks backward on the module's outputs, which an in-place
            # op on a view would silently bypass (it warns "returned a view tensor").
            return self.get_submodule(family.value_head_module)(hidden).sum(dim=-1, dtype=torch.float32)
        logits = self.get_submodule(family.lm_head_module)(hidden)
        if labels is None:
            return logits
        log_probs, entropy = token_log_probs(logits, labels, position_ids, with_entropy=self.compute_entropy)
        return (log_probs, entropy, logits) if self.return_logits else (log_probs, entropy)


def build_stage(hf_model: nn.Module, pp: int, pp_rank: int) -> DecoderStage:
    """The stage ``pp_rank`` of ``pp`` of ``hf_model``, cut by ``pipeline_stages``.

    The stage takes (does not copy) the HF model's modules; the rest of ``hf_model`` is
    dropped by the caller.
    """
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, {pp})")
    stages = pipeline_stages(hf_model.config, pp, head=head_kind(hf_model))
    return DecoderStage(hf_model, stages[pp_rank])


def tied_embedding_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """Group of this rank's first- and last-stage peers (same dp and tp coordinates).

    Returns ``None`` when this rank is on a middle stage or ``pp == 1``. Only the members
    of each group create it (local synchronization), so idle ranks are not involved.
    """
    pp = mesh["pp"].size()
    if pp == 1:
        return None
    coords = mesh.get_coordinate()
    pp_rank, dp_rank, tp_rank = coords
    if pp_rank not in (0, pp - 1):
        return None
    if pp == 2:
        return mesh["pp"].get_group()
    grid = mesh.mesh  # (pp, dp, tp) tensor of global ranks
    ranks = [int(grid[0, dp_rank, tp_rank]), int(grid[pp - 1, dp_rank, tp_rank])]
    return dist.new_group(ranks, use_local_synchronization=True)


def build_schedule(
    stage_module: DecoderStage,
    mesh: DeviceMesh,
    *,
    device: torch.device,
    num_micro_batches: int,
    input_example: torch.Tensor,
    output_example: torch.Tensor | tuple[torch.Tensor, ...],
    loss_fn=None,
    schedule: str = "1f1b",
    forward_only: bool = False,
):
    """A torch pipelining schedule for ``stage_module`` on the ``pp`` axis of ``mesh``.

    Shapes are given up front (``input_example`` / ``output_example``, e.g. on the meta
    device) so the stages skip torch's runtime shape inference, which would run an extra
    forward through the FSDP-wrapped stage.

    Args:
        stage_module: this rank's stage.
        mesh: the ``("pp", "dp", "tp")`` mesh.
        device: this rank's device.
        num_micro_batches: micro-batches per ``step``; 1F1B needs at least ``pp`` of them
            and falls back to GPipe below that.
        input_example: one micro-batch's stage input.
        output_example: one micro-batch's stage output.
        loss_fn: ``loss_fn(stage_output, target) -> loss`` on the last stage; ``None`` for
            forward-only use (``schedule.eval``).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        forward_only: build torch's forward-only schedule (inference): micro-batches flow
            through the stages without any backward bookkeeping.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.schedules import _ScheduleForwardOnly

    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule={schedule!r}; expected '1f1b' or 'gpipe'")
    pp_mesh = mesh["pp"]
    stage = PipelineStage(
        stage_module,
        pp_mesh.get_local_rank(),
        pp_mesh.size(),
        device,
        input_args=input_example,
        output_args=output_example,
        group=pp_mesh.get_group(),
    )
    if forward_only:
        return _ScheduleForwardOnly(stage, n_microbatches=num_micro_batches)
    cls = Schedule1F1B if schedule == "1f1b" and num_micro_batches >= pp_mesh.size() else ScheduleGPipe
    # scale_grads=False: the engine's loss is already normalised by the global token count.
    return cls(stage, n_microbatches=num_micro_batches, loss_fn=loss_fn, scale_grads=False)


# Shape fields of an HF config shrunk for :func:`stage_forward_mismatch`, and their small values;
# the model's own multipliers, soft-caps, norms and attention kinds stay as configured.
_SMALL_SHAPES = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 16, "vocab_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2,
}  # fmt: skip
_TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _small_copy(config) -> object:
    """``config`` with the shapes of :data:`_SMALL_SHAPES` (fields it has), two layers and token ids in range."""
    from transformers import AutoConfig

    fields = config.to_dict()
    small = {k: v for k, v in _SMALL_SHAPES.items() if k in fields}
    kv, heads = fields.get("num_key_value_heads"), fields.get("num_attention_heads")
    if kv is not None:
        small["num_key_value_heads"] = 4 if kv == heads else 2 if kv > 1 else 1
    small["num_hidden_layers"] = min(2, fields["num_hidden_layers"])
    if fields.get("sliding_window"):  # a window shorter than the check's rows: a wrong mask shows
        small["sliding_window"] = 3
    if fields.get("layer_types"):
        small["layer_types"] = fields["layer_types"][: small["num_hidden_layers"]]
    for key in _TOKEN_ID_FIELDS:
        ids = fields.get(key)
        if isinstance(ids, int) and ids >= small.get("vocab_size", fields["vocab_size"]):
            small[key] = None
        elif isinstance(ids, list):
            small[key] = [i for i in ids if i < small.get("vocab_size", fields["vocab_size"])] or None
    rest = {k: v for k, v in fields.items() if k not in ("model_type", "architectures")}
    return AutoConfig.for_model(fields["model_type"], **{**rest, **small})


def stage_forward_mismatch(config, causal_lm_class: type) -> str | None:
    """Why :class:`DecoderStage` computes other logits than the HF model of ``config``, or None.

    A stage runs the family's items (embedding, layers with one rotary table and the attention
    kinds' masks, final norm, LM head) itself, so a model whose HF forward does more (scales
    the logits, soft-caps them, a rotary table per attention kind) would train other than it
    generates in HF. Checked on a random copy of ``config`` shrunk to two small layers and a
    sliding window (where it has one) shorter than the rows (its multipliers, caps and norms
    kept), on CPU in float32: a fraction of a second.

    Args:
        config: an HF causal LM config.
        causal_lm_class: its ``*ForCausalLM`` class.
    """
    try:
        small = _small_copy(config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = causal_lm_class(small).float().eval()
        ids = torch.randint(0, small.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
        mask, positions = torch.ones_like(ids), torch.arange(6).expand(2, 6)
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
            got = DecoderStage(model, [item for item, _ in pipeline_items(small)])(
                ids, attention_mask=mask, position_ids=positions
            )
    except Exception as err:  # any failure of the copy or of the stage: the model is not run by a stage
        return f"a stage of its items cannot run it ({type(err).__name__}: {err})"
    gap = (got - expected).abs().max().item()
    if gap > 1e-4 * max(1.0, expected.abs().max().item()):
        return (
            f"its HF forward computes other logits than embedding -> layers -> norm -> LM head (max |difference| "
            f"{gap:.3g} on a small random copy): it scales or soft-caps them, or does more between the items"
        )
    return None
