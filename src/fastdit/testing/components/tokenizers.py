"""Tokenizers built locally from small vocabularies: no Hub access, deterministic, real transformers classes."""

from __future__ import annotations

import copy
import functools
import string
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "WORDS",
    "byte_level_bpe",
    "cached_copy",
    "clip_tokenizer",
    "merge_left_to_right",
    "qwen2_tokenizer",
    "qwen_chat_tokenizer",
    "t5_tokenizer",
]

F = TypeVar("F", bound=Callable[..., Any])


def cached_copy(builder: F) -> F:
    """Build once per argument set, hand out deep copies: pipelines mutate their tokenizers (padding side, pad
    token), and one pipeline's change must not leak into another's."""
    built = functools.cache(builder)

    @functools.wraps(builder)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return copy.deepcopy(built(*args, **kwargs))

    return wrapper  # type: ignore[return-value]


def merge_left_to_right(pieces: list[str], vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """Add the BPE merges that join ``pieces`` into one token, left to right, to ``merges`` and ``vocab``.

    ``["c", "a", "t</w>"]`` adds the merges ``("c", "a")`` then ``("ca", "t</w>")`` and the merged pieces ``"ca"``
    and ``"cat</w>"``; merges and pieces already present are kept as they are.

    Args:
        pieces: The word split into its initial pieces (characters or bytes), all already in ``vocab``.
        vocab: Token-to-id map; a new merged piece gets the next free id.
        merges: The BPE merge list, in priority order; a new merge is appended.
    """
    while len(pieces) > 1:
        pair = (pieces[0], pieces[1])
        if pair not in merges:
            merges.append(pair)
        merged = pieces[0] + pieces[1]
        vocab.setdefault(merged, len(vocab))
        pieces = [merged, *pieces[2:]]


# Words the tiny pipelines and the reference pipeline are prompted with.
WORDS: tuple[str, ...] = (
    "a", "an", "the", "of", "handwritten", "digit", "photo", "cat", "dog", "sign", "holding", "red", "blue",
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
)  # fmt: skip


@cached_copy
def clip_tokenizer(model_max_length: int = 77):
    """A ``CLIPTokenizer`` over single characters and :data:`WORDS` (word pieces end in ``</w>``)."""
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    for token in ("<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    for ch in string.ascii_lowercase + string.digits + string.punctuation:
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        merge_left_to_right([*word[:-1], word[-1] + "</w>"], vocab, merges)
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=model_max_length,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


@cached_copy
def t5_tokenizer(model_max_length: int = 64, extra_words: tuple[str, ...] = ()):
    """A ``T5TokenizerFast`` (unigram) over :data:`WORDS` and single characters.

    Args:
        model_max_length: Longest input the tokenizer accepts.
        extra_words: Whole-word pieces added after :data:`WORDS` (the video reference's motion words). The default
            adds none, and only then are the ids those of every other pipeline's T5 tokenizer: extra words shift the
            ids of the single characters.

    Returns:
        A new tokenizer.
    """
    from transformers import T5TokenizerFast

    pieces = ["<pad>", "</s>", "<unk>"]
    scores = [0.0, 0.0, 0.0]
    for word in dict.fromkeys(WORDS + tuple(extra_words)):
        pieces.append("▁" + word)
        scores.append(-1.0)
    for ch in string.ascii_lowercase + string.digits + string.punctuation:
        for piece in (ch, "▁" + ch):
            if piece not in pieces:
                pieces.append(piece)
                scores.append(-5.0)
    pieces.append("▁")
    scores.append(-8.0)
    return T5TokenizerFast(vocab=list(zip(pieces, scores, strict=True)), extra_ids=0, model_max_length=model_max_length)


def byte_level_bpe(special_tokens: tuple[str, ...], model_max_length: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` whose vocabulary is the 256 bytes, :data:`WORDS` and the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges: list[tuple[str, str]] = []
    space = "Ġ"  # byte-level encoding of " "
    for word in WORDS:
        merge_left_to_right(list(space + word), vocab, merges)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    return tok


def qwen_chat_tokenizer(special_tokens: tuple[str, ...], model_max_length: int, **kwargs: Any):
    """A ``Qwen2TokenizerFast`` over :func:`byte_level_bpe` with Qwen's ChatML EOS and pad tokens and no BOS.

    Args:
        special_tokens: Special tokens of the vocabulary; must include ``<|im_end|>`` and ``<|endoftext|>``.
        model_max_length: Longest input the tokenizer accepts.
        **kwargs: Further ``Qwen2TokenizerFast`` arguments (e.g. ``chat_template``).

    Returns:
        A new tokenizer.
    """
    from transformers import PreTrainedTokenizerFast, Qwen2TokenizerFast

    base = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(special_tokens, model_max_length))
    return Qwen2TokenizerFast(
        tokenizer_object=base._tokenizer,
        model_max_length=model_max_length,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        **kwargs,
    )


@cached_copy
def qwen2_tokenizer(model_max_length: int = 256):
    """A ``Qwen2TokenizerFast`` (byte-level BPE) with the chat special tokens Qwen pipelines use."""
    specials = (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
        "<|image_pad|>", "<|video_pad|>",
    )  # fmt: skip
    return qwen_chat_tokenizer(specials, model_max_length)
