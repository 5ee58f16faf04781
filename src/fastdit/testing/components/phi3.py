"""A tiny Phi-3-style tokenizer built locally (OmniGen: the pipeline wraps it in ``OmniGenMultiModalProcessor``).

Phi-3's tokenizer is Llama's SentencePiece layout: ``<unk>``, ``<s>``, ``</s>`` at ids 0, 1, 2, a BOS prepended to
every encoding, and the chat tags (``<|user|>``, ``<|assistant|>``, ``<|end|>``) as added tokens. OmniGen's
processor relies on that layout: it tokenizes each text chunk between image placeholders on its own and drops a
leading id 1 (the BOS) from every chunk after the first, and its collator pads with id 2. The vocabulary is a
unigram model over the shared test words and single characters, so any prompt encodes.
"""

from __future__ import annotations

import string

from fastdit.testing.components.tokenizers import WORDS, cached_copy

__all__ = ["PHI3_TAGS", "phi3_tokenizer"]

# Added (non-special) tokens: the chat tags and OmniGen's image delimiters, each one id as in the real vocabulary.
PHI3_TAGS: tuple[str, ...] = ("<|user|>", "<|assistant|>", "<|end|>", "<|diffusion|>", "<img>", "</img>", "\n")


@cached_copy
def phi3_tokenizer(model_max_length: int = 1024):
    """A ``PreTrainedTokenizerFast`` with Llama's special ids (``<s>`` = 1 prepended, ``</s>`` = 2) and the tags."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces: list[tuple[str, float]] = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    seen = {piece for piece, _ in pieces}
    for word in WORDS:
        pieces.append(("▁" + word, -1.0))
        seen.add("▁" + word)
    for ch in string.ascii_letters + string.digits + string.punctuation:
        for piece in (ch, "▁" + ch):
            if piece not in seen:
                pieces.append((piece, -5.0))
                seen.add(piece)
    pieces.append(("▁", -8.0))
    backend = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.add_tokens([AddedToken(tag, normalized=False, special=False) for tag in PHI3_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=model_max_length,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
