"""A tiny Mistral 3 (Mistral-Small-3.x) text/vision encoder and a Mistral-style tokenizer, built locally (FLUX.2).

Checkpoints ship a ``PixtralProcessor``, which transformers only builds when torchvision is installed (it is not
installable beside our CPU torch). Pipelines that encode text prompts only call ``apply_chat_template`` on it, which a
tokenizer answers the same way, so the tiny pipelines use the tokenizer alone. It is byte-level BPE with Mistral's
instruction and image special tokens and a short chat template of our own that renders the layout the pipelines
expect: ``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]`` with ``[IMG]`` for image parts.
"""

from __future__ import annotations

from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
from fastdit.testing.components.encoders import build
from fastdit.testing.components.tokenizers import byte_level_bpe

__all__ = ["MISTRAL3_CHAT_TEMPLATE", "MISTRAL3_SPECIALS", "mistral3_model", "mistral3_tokenizer"]

MISTRAL3_SPECIALS: tuple[str, ...] = (
    "<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[IMG]", "[IMG_BREAK]", "[IMG_END]",
)  # fmt: skip

# Message contents may be a string or a list of {"type": "text" | "image", ...} parts.
MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[INST]{% endif %}"
    "{% for part in parts %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}[IMG]{% endif %}"
    "{% endfor %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[/INST]"
    "{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)

_VISION_PATCH = 14


def mistral3_tokenizer(model_max_length: int = 1024):
    """A ``PreTrainedTokenizerFast`` over bytes, the test words and :data:`MISTRAL3_SPECIALS`, with a chat template.

    Returns a new instance on every call: pipelines may change tokenizer settings.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(MISTRAL3_SPECIALS, model_max_length),
        model_max_length=model_max_length,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=MISTRAL3_CHAT_TEMPLATE,
    )


def mistral3_model(hidden_size: int = 32, num_layers: int = 3, seed: int = 0):
    """``(Mistral3ForConditionalGeneration, tokenizer)``: 2 query heads over 1 KV head, a 1-layer vision tower."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = mistral3_tokenizer()
    config = Mistral3Config(
        text_config=decoder_lm_kwargs(
            tok, hidden_size, num_layers, max_position_embeddings=2048, model_type="mistral", sliding_window=None
        ),
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "image_size": 112,
            "patch_size": _VISION_PATCH,
        },
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
    )
    return build(Mistral3ForConditionalGeneration, config, seed=seed), tok
