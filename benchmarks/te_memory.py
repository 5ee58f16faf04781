"""Per-rank text-encoder weight memory under ``Parallel(text_encoder=True)``, for real model shapes (``meta``).

For each encoder (the class the pipelines load, with its published config), the encoder's plan at degrees 1, 2, 4
and 8 — the plan of the fallback chain that fits (``mlp-only`` where the heads or KV heads do not divide) — as
:func:`~fastdit.parallel.tensor_parallel.planned_bytes` computes it from shapes alone: no weight is allocated.

    python benchmarks/te_memory.py --out benchmarks/results/<date>_cpu_te_memory.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch

from fastdit.bench import json_ready, markdown_table
from fastdit.components.text_encoders import text_encoder_plan
from fastdit.io import write_json
from fastdit.parallel.tensor_parallel import planned_bytes

DEGREES = (1, 2, 4, 8)


def _t5(cls: str, config: str, vocab: int) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        import transformers

        cfg = getattr(transformers, config)(
            d_model=4096,
            d_kv=64,
            d_ff=10240,
            num_layers=24,
            num_heads=64,
            vocab_size=vocab,
            feed_forward_proj="gated-gelu",
        )
        return getattr(transformers, cls)(cfg)

    return make


def _qwen2_5_vl_7b() -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
    )  # fmt: skip
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584)
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text, vision_config=vision, vocab_size=152064)
    )


def _mistral_small_3() -> torch.nn.Module:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(
        model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072, tie_word_embeddings=False,
    )  # fmt: skip
    vision = dict(
        model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=16, image_size=1540, patch_size=14,
    )  # fmt: skip
    return Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision))


def _gemma2_2b() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2Model

    return Gemma2Model(
        Gemma2Config(
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            vocab_size=256000,
        )
    )


def _llama_3_1_8b() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=False,
        )
    )


def _clip_l() -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            vocab_size=49408,
            max_position_embeddings=77,
        )
    )


# Label → builder of the encoder class the pipelines load (FLUX.1, Wan, Qwen-Image, FLUX.2, Sana, HiDream, ...).
MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "T5-XXL (FLUX.1, SD3)": _t5("T5EncoderModel", "T5Config", 32128),
    "UMT5-XXL (Wan)": _t5("UMT5EncoderModel", "UMT5Config", 256384),
    "Qwen2.5-VL-7B (Qwen-Image)": _qwen2_5_vl_7b,
    "Mistral-Small-3 (FLUX.2)": _mistral_small_3,
    "Gemma2-2B (Sana)": _gemma2_2b,
    "Llama-3.1-8B (HiDream)": _llama_3_1_8b,
    "CLIP-L (FLUX.1, SD3)": _clip_l,
}


def row_for(label: str, make: Callable[[], torch.nn.Module]) -> dict[str, Any]:
    """Per-rank bytes of one encoder at every degree (``None`` where no plan of the chain fits)."""
    with torch.device("meta"):
        model = make().to(torch.bfloat16)
    plan = text_encoder_plan(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    row: dict[str, Any] = {"model": label, "class": type(model).__name__, "params_b": round(total / 2 / 1e9, 2)}
    for degree in DEGREES:
        try:
            planned = planned_bytes(model, plan, degree, label)
        except ValueError:
            row[f"te{degree}_gib"] = row[f"te{degree}_plan"] = None
            continue
        row[f"te{degree}_gib"] = round(planned["parameter_bytes_per_rank"] / 2**30, 2)
        row[f"te{degree}_plan"] = planned["plan"]
    return row


def _cell(row: dict[str, Any], degree: int) -> str:
    gib = row[f"te{degree}_gib"]
    if gib is None:
        return "-"
    plan = row[f"te{degree}_plan"]
    return f"{gib}" if plan == "full" else f"{gib} ({plan})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = [row_for(label, make) for label, make in MODELS.items()]
    header = ("encoder", "class", "params (B)", *(f"GiB/rank at {d}" for d in DEGREES))
    cells = [(r["model"], r["class"], r["params_b"], *(_cell(r, d) for d in DEGREES)) for r in rows]
    print("\nText-encoder weights per rank (bf16), from the plans on the meta device\n")
    print(markdown_table(header, cells), end="")
    if args.out is not None:
        payload = {"benchmark": "te_memory", "date": date.today().isoformat(), "torch": torch.__version__, "rows": rows}
        write_json(args.out, json_ready(payload))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
