"""A character-level tokenizer for synthetic tasks, built locally (no model hub).

Every character of an alphabet is one token, after four special tokens
``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2), ``<unk>`` (3). It is a ``tokenizers`` WordLevel
model behind a pre-tokenizer that isolates every character, wrapped as a
``transformers.PreTrainedTokenizerFast``, so engines use it exactly like a real tokenizer:
``save_pretrained`` writes ``tokenizer.json`` and ``AutoTokenizer.from_pretrained`` reads it
back.
"""

from __future__ import annotations

import logging
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["DEFAULT_ALPHABET", "SPECIAL_TOKENS", "build_char_tokenizer", "load_tokenizer", "with_pad_token"]

logger = logging.getLogger(__name__)
_PAD_FROM_EOS_SAID: set[str] = set()  # tokenizer paths whose EOS padding was already announced

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}

# Digits first so that digit ids are 4..13 whatever else the alphabet holds.
DEFAULT_ALPHABET = string.digits + string.punctuation + " \n" + string.ascii_letters


def build_char_tokenizer(
    alphabet: str = DEFAULT_ALPHABET,
    add_bos: bool = True,
    padding_side: str = "left",
    model_max_length: int = 2048,
) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer over ``alphabet``.

    Args:
        alphabet: the characters, each becoming one token (ids from 4 on, in this order).
            Characters outside it encode to ``<unk>``.
        add_bos: prepend ``<bos>`` when encoding with ``add_special_tokens=True``.
        padding_side: ``"left"`` (prompts for generation: the last prompt token of every row
            sits at the same position) or ``"right"`` (training batches).
        model_max_length: the length ``truncation=True`` cuts to.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``pad/bos/eos/unk`` set; ``decode`` concatenates
        characters, so ``decode(encode(s), skip_special_tokens=True) == s`` for ``s`` over
        the alphabet.

    Raises:
        ValueError: empty alphabet, repeated characters, or a bad ``padding_side``.

    >>> tok = build_char_tokenizer("0123456789+=")
    >>> tok("12+3=").input_ids
    [1, 5, 6, 14, 7, 15]
    >>> tok.decode([1, 5, 6, 14, 7, 15, 2], skip_special_tokens=True)
    '12+3='
    """
    if not alphabet:
        raise ValueError("alphabet is empty")
    repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if repeated:
        raise ValueError(f"alphabet repeats characters {repeated}")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side={padding_side!r}; expected 'left' or 'right'")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS.values())}
    vocab.update({char: len(SPECIAL_TOKENS) + i for i, char in enumerate(alphabet)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    # [\s\S] rather than "." so that newlines are characters too.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # join characters without the spaces WordLevel would insert
    if add_bos:
        bos = SPECIAL_TOKENS["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        padding_side=padding_side,
        model_max_length=model_max_length,
        # The default clean-up rewrites " ." to "." and would break decode(encode(s)) == s.
        clean_up_tokenization_spaces=False,
        **SPECIAL_TOKENS,
    )


def load_tokenizer(path: str, padding_side: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer saved with ``save_pretrained`` (any HF tokenizer, not only ours).

    Args:
        path: directory holding ``tokenizer.json`` / ``tokenizer_config.json``.
        padding_side: override the saved padding side (``"left"`` for generation).
    """
    kwargs = {} if padding_side is None else {"padding_side": padding_side}
    return with_pad_token(AutoTokenizer.from_pretrained(path, **kwargs), path)


def with_pad_token(tokenizer: PreTrainedTokenizerBase, where: str) -> PreTrainedTokenizerBase:
    """``tokenizer``, padding with its EOS token when it has no pad token (Llama's), as TRL does.

    Padding positions are masked everywhere rlflow pads, so the EOS id there is never learned
    from; it is said once per tokenizer ``where``.

    Raises:
        ValueError: the tokenizer has neither a pad token nor an EOS token; names ``where``.
    """
    if tokenizer.pad_token is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise ValueError(
            f"tokenizer {where} has neither a pad token nor an EOS token; set one before training "
            "(tokenizer.pad_token = ...; tokenizer.save_pretrained(...))"
        )
    tokenizer.pad_token = tokenizer.eos_token
    if where not in _PAD_FROM_EOS_SAID:
        _PAD_FROM_EOS_SAID.add(where)
        logger.warning(
            "tokenizer %s has no pad token: padding with its EOS token %r (id %d)",
            where, tokenizer.eos_token, tokenizer.eos_token_id,
        )  # fmt: skip
    return tokenizer
