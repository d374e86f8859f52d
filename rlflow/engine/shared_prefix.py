"""Rows that share a prompt, run as one sequence per prompt: the prompt once, then every row's own tokens.

A GRPO-style rollout draws ``n`` responses to each prompt, so a training batch holds ``n`` rows
that begin with the same prompt tokens. The padded forward computes those tokens ``n`` times; a
causal decoder's states at a prompt token depend on the prompt alone, so they are the same each
time. :func:`shared_prefix_layout` lays a micro-batch out as one sequence per prompt (a *group*):
the prompt's real tokens, then each row's own real tokens (its response, observations included)
one row after another, with an attention mask that lets a row's tokens see the prompt and the
earlier tokens of their own row only — a tree with the prompt as its trunk. Every token keeps its
position in its row (the rotary angle is the same), so each token's hidden state is the one the
padded forward computes, and the decoder layers run on ``Σ prompts + Σ own tokens`` instead of
``rows × width`` tokens. :meth:`SharedPrefix.unpack` puts the final hidden states back into the
padded ``(B, T, H)`` layout (each row reads the prompt's states), so the head, the log-probs and
the losses run unchanged; in backward the prompt's states gather the gradients of every row.

Which columns are the prompt: the rows follow the rollout layout (left-padded prompt, then the
response), and ``response_mask`` marks generated tokens: the prompt is every column before the
first one any row generated in. Rows whose prompt columns hold the same tokens (and padding) form
one group, wherever they are in the micro-batch.

The layout is taken only where it is estimated cheaper (:func:`rlflow.planner.cost.shares_prompts`,
which prices it for the planner too): the projections and MLPs cost per token, attention per
(query, key) pair; a group's sequence attends over all of its rows' tokens (a dense ``L × L``
mask), so long responses to a short prompt cost more this way than padded rows do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlflow.planner.cost import shares_prompts

__all__ = ["MASK_ELEMENT_LIMIT", "SharedPrefix", "prompt_groups", "shared_prefix_layout"]

# At most this many entries in the groups' masks together (bool): beyond it the dense masks' memory
# and the attention over them outgrow what sharing saves.
MASK_ELEMENT_LIMIT = 1 << 26


@dataclass(frozen=True)
class SharedPrefix:
    """A micro-batch of ``B`` rows of ``T`` columns laid out as ``G`` groups of ``L`` slots.

    Attributes:
        pack_index: ``(G * L,)`` row-major index into the ``(B * T)`` tokens: the token each slot
            holds (padding slots: 0, never read back).
        unpack_index: ``(B * T,)`` index into the ``G * L`` slots and one more (``G * L``, zeros):
            the slot each token's state is read from; padding columns read the zero slot.
        position_ids: ``(G, L)`` each slot's position in its row (0 on padding slots).
        mask: ``(G, 1, L, L)`` bool, True where a query slot may attend to a key slot.
    """

    pack_index: torch.Tensor
    unpack_index: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor

    @property
    def groups(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[-1]

    def to(self, device: torch.device) -> SharedPrefix:
        return SharedPrefix(*(t.to(device) for t in (self.pack_index, self.unpack_index, self.position_ids, self.mask)))

    def pack(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(B, T, H)`` states (or ``(B, T)`` ids) of the padded rows as ``(G, L, ...)`` slots."""
        flat = hidden.reshape(-1, *hidden.shape[2:])
        return flat.index_select(0, self.pack_index).view(self.groups, self.length, *hidden.shape[2:])

    def unpack(self, hidden: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """``(G, L, H)`` slot states as the padded ``(rows, width, H)`` layout (zeros at padding)."""
        flat = hidden.reshape(-1, *hidden.shape[2:])
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return flat.index_select(0, self.unpack_index).view(rows, width, *hidden.shape[2:])


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, int] | None:
    """``(group, prompt)``: each row's group (rows whose prompt columns hold the same tokens and
    padding; ``(B,)`` ids from 0) and the prompt's width (the columns before the first generated
    token of any row); ``None`` when no row generated a token or none starts with a prompt."""
    generated = response_mask.bool().any(dim=0).nonzero()
    if generated.numel() == 0 or int(generated[0]) == 0:
        return None
    prompt = int(generated[0])
    real = attention_mask[:, :prompt].bool()
    key = torch.cat([input_ids[:, :prompt] * real, real.long()], dim=1)
    return torch.unique(key, dim=0, return_inverse=True)[1], prompt


def shared_prefix_layout(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_mask: torch.Tensor,
    layer_params: int,
    pair_cost: int,
) -> SharedPrefix | None:
    """The grouped layout of a micro-batch, or ``None`` where it is not estimated cheaper.

    Args:
        input_ids, attention_mask, position_ids: ``(B, T)`` padded rows (left-padded prompt, then
            the row's own tokens).
        response_mask: ``(B, T)``, nonzero on generated tokens; the prompt is every column before
            the first one it marks in any row.
        layer_params: multiplying parameters of one decoder layer (a token's projections and MLP).
        pair_cost: multiply-adds of attention per query-key pair in one layer (``2 × q width``).

    Returns:
        ``None`` when no two rows share a prompt, when no row generated a token, when the masks
        would hold more than :data:`MASK_ELEMENT_LIMIT` entries, or when the layout is not
        estimated cheaper (:func:`rlflow.planner.cost.shares_prompts`).
    """
    rows, width = attention_mask.shape
    real = attention_mask.bool()
    found = prompt_groups(input_ids, attention_mask, response_mask) if rows > 1 else None
    if found is None:
        return None
    group, prompt = found
    groups = int(group.max()) + 1
    if groups == rows:
        return None
    shared = real[:, :prompt].sum(dim=1)  # the same within a group
    own = real[:, prompt:].sum(dim=1)
    heads = torch.full((groups,), rows, dtype=torch.long).scatter_reduce(
        0, group, torch.arange(rows), reduce="amin"
    )  # first row of each group
    lengths = shared[heads].clone().index_add_(0, group, own)
    length = int(lengths.max())
    if groups * length * length > MASK_ELEMENT_LIMIT:
        return None
    if not shares_prompts(rows, width, groups, length, layer_params, pair_cost):
        return None
    return _build(group, heads, own, real, position_ids, prompt, groups, length)


def _build(group, heads, own, real, position_ids, prompt, groups, length) -> SharedPrefix:
    rows, width = real.shape
    # A row's own tokens follow the prompt and the own tokens of the group's earlier rows: its
    # offset is what those rows hold (rows ordered by group, then by index).
    order = torch.argsort(group * rows + torch.arange(rows))
    before = torch.cumsum(own[order], 0) - own[order]  # own tokens of the rows ordered before
    counts = torch.bincount(group, minlength=groups)
    first = before[torch.cumsum(counts, 0) - counts]  # `before` at each group's first row
    offset = torch.empty(rows, dtype=torch.long)
    offset[order] = before - first[group[order]]
    # Slot of every real token: its rank among the row's real tokens (the prompt's come first),
    # own tokens moved past the group's earlier rows.
    cols = torch.arange(width)[None, :]
    is_own = cols >= prompt
    slot = torch.cumsum(real.long(), dim=1) - 1 + is_own * offset[:, None]
    flat_slot = group[:, None] * length + slot  # (B, T)
    unpack_index = torch.where(real, flat_slot, torch.full_like(flat_slot, groups * length)).flatten()
    # A slot takes its token from the group's first row for the prompt, from the row itself after.
    is_head = torch.zeros(rows, dtype=torch.bool)
    is_head[heads] = True
    source = real & (is_own | is_head[:, None])
    targets = flat_slot[source]
    pack_index = torch.zeros(groups * length, dtype=torch.long)
    pack_index[targets] = torch.arange(rows * width).view(rows, width)[source]
    slot_positions = torch.zeros(groups * length, dtype=position_ids.dtype)
    slot_positions[targets] = position_ids[source]
    # Who owns each slot: -1 the prompt, a row's index its own tokens, -2 padding.
    owner = torch.full((groups * length,), -2, dtype=torch.long)
    owner[targets] = torch.where(is_own, torch.arange(rows)[:, None], -1)[source]
    owner = owner.view(groups, length)
    query, key = owner[:, :, None], owner[:, None, :]
    sees = ((key == -1) & (query != -2)) | (key == query)
    mask = (torch.ones(length, length, dtype=torch.bool).tril() & sees) | torch.eye(length, dtype=torch.bool)
    return SharedPrefix(
        pack_index=pack_index,
        unpack_index=unpack_index,
        position_ids=slot_positions.view(groups, length),
        mask=mask[:, None],
    )
