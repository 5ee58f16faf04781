"""Per-GPU transformer weight memory under tensor parallelism, for the real model shapes (no weights: ``meta``).

For each model, the family's TP plan at degrees 1-8 (the plan of the fallback chain that fits), and for families
whose plan splits the per-block AdaLN modulation, the same plan with the modulation kept whole (what diffusers'
``_tp_plan`` does) — the weight side of "split the modulation or replicate it" (the other side, one small
all-gather per block, needs two GPUs: ``cp_flux.py --modes tp``).

    python benchmarks/tp_memory.py --out benchmarks/results/<date>_cpu_tp_memory.json
"""

from __future__ import annotations

import argparse
from datetime import date
from pathlib import Path
from typing import Any

import torch

from fastdit.bench import json_ready, markdown_table
from fastdit.io import write_json
from fastdit.models.registry import get_family
from fastdit.parallel.tensor_parallel import planned_bytes
from fastdit.parallel.tp_plan import Colwise, TensorParallelPlan

# Published configs (bf16 weights), by diffusers class.
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "FLUX.1-dev": ("flux", "FluxTransformer2DModel", {"guidance_embeds": True}),
    "FLUX.2-dev": ("flux2", "Flux2Transformer2DModel", {}),
    "Qwen-Image": (
        "qwenimage",
        "QwenImageTransformer2DModel",
        {
            "num_layers": 60,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 3584,
            "guidance_embeds": False,
        },
    ),
    "Wan2.1-14B": (
        "wan",
        "WanTransformer3DModel",
        {
            "num_layers": 40,
            "num_attention_heads": 40,
            "ffn_dim": 13824,
            "patch_size": (1, 2, 2),
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 4096,
        },
    ),
    "HunyuanVideo": ("hunyuan_video", "HunyuanVideoTransformer3DModel", {}),
    "CogVideoX-5B": (
        "cogvideox",
        "CogVideoXTransformer3DModel",
        {"num_attention_heads": 48, "num_layers": 42, "use_rotary_positional_embeddings": True},
    ),
    "SD3.5-Large": (
        "sd3",
        "SD3Transformer2DModel",
        {
            "num_layers": 38,
            "num_attention_heads": 38,
            "attention_head_dim": 64,
            "caption_projection_dim": 2432,
            "pos_embed_max_size": 192,
            "qk_norm": "rms_norm",
            "out_channels": 16,
            "in_channels": 16,
            "sample_size": 128,
        },
    ),
}
DEGREES = (1, 2, 4, 8)


def without_modulation(plan: TensorParallelPlan) -> TensorParallelPlan | None:
    """``plan`` with every gathered-output (modulation) layer kept whole, or ``None`` if it splits none."""
    kept = {k: v for k, v in plan.layers.items() if not (isinstance(v, Colwise) and v.gather_output)}
    if len(kept) == len(plan.layers):
        return None
    optional = tuple(p for p in plan.optional if p in kept or p in {d.rpartition(".")[0] for d in plan.divide})
    return TensorParallelPlan(layers=kept, divide=plan.divide, optional=optional, name=plan.name + ", modulation whole")


def build(cls_name: str, config: dict[str, Any]) -> torch.nn.Module:
    import diffusers

    with torch.device("meta"):
        return getattr(diffusers, cls_name)(**config).to(torch.bfloat16)


def rows_for(label: str, family: str, cls_name: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    model = build(cls_name, config)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = get_family(family).tp_plan
    variants = [("fastdit", plan)]
    whole = without_modulation(plan)
    if whole is not None:
        variants.append(("modulation whole", whole))
    rows = []
    for variant, candidate in variants:
        row: dict[str, Any] = {"model": label, "plan": variant, "params_b": round(total / 2 / 1e9, 2)}
        for degree in DEGREES:
            try:
                planned = planned_bytes(model, candidate, degree, family)
            except ValueError:
                row[f"tp{degree}_gib"] = None
                continue
            row[f"tp{degree}_gib"] = round(planned["parameter_bytes_per_rank"] / 2**30, 2)
            row[f"tp{degree}_plan"] = planned["plan"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = [row for label, spec in MODELS.items() for row in rows_for(label, *spec)]
    header = ("model", "plan", "params (B)", *(f"TP-{d} GiB/GPU" for d in DEGREES))
    cells = [
        (r["model"], r["plan"], r["params_b"], *("-" if r[f"tp{d}_gib"] is None else r[f"tp{d}_gib"] for d in DEGREES))
        for r in rows
    ]
    print("\nTransformer weights per GPU (bf16), from the plans on the meta device\n")
    print(markdown_table(header, cells), end="")
    if args.out is not None:
        payload = {"benchmark": "tp_memory", "date": date.today().isoformat(), "torch": torch.__version__, "rows": rows}
        write_json(args.out, json_ready(payload))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
