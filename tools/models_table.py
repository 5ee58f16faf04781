"""Write docs/models.md: every transformer class diffusers ships, with fastdit's status for it.

    python tools/models_table.py            # rewrites docs/models.md
    python tools/models_table.py --check    # exits 1 if docs/models.md is out of date (used by the tests)

Supported classes come from the registry (each family file); for the others, the reason is recorded below.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import diffusers
import diffusers.models.transformers as transformers_package
import torch

from fastdit.models.base import NO_LATENT, qualified_name
from fastdit.models.registry import all_adapters

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "models.md"

# Why a transformer class has no adapter (class name → reason). Classes absent here and from the registry are
# DiTs that are simply not integrated yet.
NOT_A_DIT = "not a diffusion transformer over image/video latents"
REASONS = {
    "DualTransformer2DModel": "legacy UNet-era cross-attention wrapper, " + NOT_A_DIT,
    "MiniMaxMusic3RVQDepthDecoder": "audio codec decoder, " + NOT_A_DIT,
    "PriorTransformer": "CLIP-embedding prior (unCLIP), " + NOT_A_DIT,
    "T5FilmDecoder": "spectrogram diffusion decoder, " + NOT_A_DIT,
    "TransformerTemporalModel": "temporal layer inside UNet video models, " + NOT_A_DIT,
    "Transformer2DModel": "generic UNet/DiT building block; served through DiT and PixArt pipelines' own classes",
    "RFD4ProteinaTransformer": "protein-structure model, " + NOT_A_DIT,
}


def transformer_classes() -> list[type]:
    """Every ``nn.Module`` class exported by ``diffusers.models.transformers``."""
    out = []
    for name in dir(transformers_package):
        obj = getattr(transformers_package, name, None)
        if inspect.isclass(obj) and issubclass(obj, torch.nn.Module) and not name.startswith("_"):
            out.append(obj)
    return sorted(out, key=lambda c: c.__name__)


NO_PLAN = "No context-parallel plan:"
NO_TP_PLAN = "No tensor-parallel plan:"
NO_CFG = "No CFG parallelism:"


def _reason(notes: str, marker: str) -> str:
    """The text after ``marker`` in ``notes``, up to the next reason marker (notes may record several)."""
    rest = notes[notes.index(marker) + len(marker) :]
    markers = (NO_PLAN, NO_TP_PLAN, NO_CFG, NO_LATENT)
    ends = [rest.index(other) for other in markers if other != marker and other in rest]
    return rest[: min(ends)].strip() if ends else rest.strip()


def cp_status(adapter) -> str:
    """The context-parallel cell: the plan's one-line summary, or the reason recorded in the adapter's notes."""
    if adapter.cp_plan is not None:
        return "✅ " + (adapter.cp_plan.notes or "plan")
    notes = " ".join(adapter.notes.split())
    if NO_PLAN in notes:
        return "❌ " + _reason(notes, NO_PLAN)
    return "❌ not planned yet"


def tp_status(adapter) -> str:
    """The tensor-parallel cell: the plan's one-line summary (and its fallback's name), or the recorded reason."""
    plan = adapter.tp_plan
    if plan is not None:
        fallback = f" Fallback: {plan.fallback.name} ({plan.fallback.notes})." if plan.fallback is not None else ""
        return "✅ " + (plan.notes or "plan") + fallback
    notes = " ".join(adapter.notes.split())
    if NO_TP_PLAN in notes:
        return "❌ " + _reason(notes, NO_TP_PLAN)
    return "❌ not planned yet"


def cfg_status(adapter) -> str:
    """The CFG-parallel cell: how the family's calls are split, or the reason it opts out."""
    notes = " ".join(adapter.notes.split())
    if not adapter.cfg_parallel:
        reason = _reason(notes, NO_CFG) if NO_CFG in notes else "opted out"
        return "❌ " + reason
    how = ["announced branches or a split batch"]
    if adapter.cfg_pairs_by_timestep:
        how.append("unannounced calls paired by timestep")
    if adapter.cfg_branch_components:
        parts = ", ".join(f"`{name}` {branch}" for name, branch in adapter.cfg_branch_components.items())
        how.append(f"one denoiser per branch ({parts})")
    if adapter.cfg_batch_dims:
        dims = ", ".join(f"`{k}` {'whole' if v is None else f'dim {v}'}" for k, v in adapter.cfg_batch_dims.items())
        how.append(f"batch found in {dims}")
    return "✅ " + "; ".join(how)


def cache_status(adapter) -> str:
    """The cache cell: every step cache, and whether TeaCache's spectral signal has a latent grid to filter."""
    if adapter.latent is not None:
        cell = f"✅ cache; spectral signal on `{adapter.latent.arg}` ({adapter.latent.describe().partition(', ')[2]})"
    else:
        cell = "✅ cache; ❌ spectral signal: " + (adapter.no_latent or "no latent declared")
    if adapter.step_invariant:
        cell += "; step-invariant: " + ", ".join(f"`{rule.module}`" for rule in adapter.step_invariant)
    return cell


def fuse_status(adapter) -> str:
    """The fused-projections cell: each block list's groups (member paths joined by +), or that there are none."""
    if not adapter.fused_projections:
        return "— none: no two Linear layers of a block take one tensor (traced)"
    lists = [
        f"`{path}`: " + "; ".join("+".join(group) for group in groups)
        for path, groups in adapter.fused_projections.items()
    ]
    return "✅ " + "; ".join(lists)


def render() -> str:
    by_class = {name: adapter for adapter in all_adapters() for name in adapter.transformer_classes}
    rows = []
    supported = with_cp = with_tp = 0
    for cls in transformer_classes():
        adapter = by_class.get(qualified_name(cls))
        if adapter is not None:
            supported += 1
            with_cp += adapter.cp_plan is not None
            with_tp += adapter.tp_plan is not None
            groups = ", ".join(f"`{g.path}` (P{g.pattern.value})" for g in adapter.block_groups)
            tiny = ", ".join(t.name for t in adapter.tiny_pipelines)
            presets = ", ".join(f"`{p.name}`" for p in adapter.presets) or "—"
            cp = cp_status(adapter).replace("|", "\\|")
            tp = tp_status(adapter).replace("|", "\\|")
            cfg = cfg_status(adapter).replace("|", "\\|")
            cache = cache_status(adapter).replace("|", "\\|")
            fuse = fuse_status(adapter).replace("|", "\\|")
            rows.append(
                f"| `{cls.__name__}` | `{adapter.family}` | {cache} | {cp} | {tp} | {cfg} | {fuse} | {groups} "
                f"| {tiny} | {presets} |"
            )
        else:
            reason = REASONS.get(cls.__name__, "DiT not integrated yet")
            rows.append(f"| `{cls.__name__}` | — | ❌ {reason} | | | | | | | |")
    header = [
        "# Model families",
        "",
        f"Generated by `python tools/models_table.py` from the registry and diffusers {diffusers.__version__}: every",
        "transformer class diffusers exports, whether fastdit has an adapter for it, the adapter's block lists with",
        "their forward pattern (P0–P5, see [adding_a_model.md](adding_a_model.md)), the tiny offline pipelines tested",
        "in CI, and the CLI model names (`fastdit list`).",
        "",
        "Every supported family is tested on each tiny pipeline: adapter vs module tree, a probe of every block call",
        "against its pattern, cache threshold 0 bit-identical to no cache, `fastdit.disable` bit-identical, a forced",
        "schedule caching exactly the expected steps. Per-family notes (masks, RoPE, loop-body work, GQA) are in",
        "each family file's `notes` and in [models/](models/).",
        "",
        "The cache column also says where TeaCache's spectral signal finds the noisy latent on its grid (the",
        "argument and its channel axis, see [cache.md](cache.md#the-spectral-signal)), or why the family has none,",
        "and the modules outside the blocks a cache serves from their first call while their inputs repeat",
        "([cache.md](cache.md#step-invariant-modules)).",
        "",
        "The context-parallel column gives the family's plan (where the sequence is split, see",
        "[parallel.md](parallel.md)) — every plan is tested on 2 and 3 gloo ranks against one process — or why there",
        "is none. The tensor-parallel column gives what the family's plan splits (see",
        "[tensor_parallel.md](tensor_parallel.md)) — every plan is tested on 2 gloo ranks against one process, alone",
        "and under a step cache — or why there is none. The CFG-parallel column says how the family's calls are",
        "split over two ranks ([cfg_parallel.md](cfg_parallel.md)); a call without an unconditional branch",
        "(guidance-distilled models) is refused at run time. The fused-projections column lists the groups of",
        "Linear layers each block applies to one tensor, which `Fuse` computes as one matmul per group",
        "([fusion.md](fusion.md)) — checked against a traced call of every tiny pipeline. Text-encoder and VAE",
        "parallelism are per component class, at the end.",
        "",
        f"**{supported} transformer classes supported; {with_cp} with context parallelism; {with_tp} with tensor "
        "parallelism.**",
        "",
        "| diffusers class | family | cache | context parallel | tensor parallel | CFG parallel | fused projections "
        "| block lists (pattern) | tiny pipelines | CLI names |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(header + rows + text_encoder_rows() + vae_rows()) + "\n"


def text_encoder_rows() -> list[str]:
    """The text-encoder table: each registered encoder class and what ``Parallel(text_encoder=True)`` splits."""
    from fastdit.components.text_encoders import plan_for_class, planned_classes

    lines = [
        "",
        "## Text encoders",
        "",
        "`Parallel(text_encoder=True)` splits every text encoder of the pipeline over all ranks of the job (see",
        "[text_encoder_parallel.md](text_encoder_parallel.md)); every class is tested on 2 gloo ranks against one",
        "process. The fallback applies at a degree the (KV) heads do not divide.",
        "",
        "| encoder class | plan | fallback |",
        "|---|---|---|",
    ]
    for name in planned_classes():
        plan = plan_for_class(name)
        fallback = plan.fallback.name if plan.fallback is not None else "—"
        lines.append(f"| `{name.rpartition('.')[2]}` | {plan.notes} | {fallback} |")
    return lines


def vae_rows() -> list[str]:
    """The VAE table: every registered VAE class and whether ``Parallel(vae=True)`` decodes it in row bands."""
    from fastdit.components.registry import VAE, registered
    from fastdit.components.vae_plans import VAE_PLANS

    lines = [
        "",
        "## VAEs",
        "",
        "`Parallel(vae=True)` decodes (and encodes) every VAE of the pipeline in row bands over all ranks, equal to",
        "the VAE's own untiled decode (see [vae_parallel.md](vae_parallel.md)); every covered class is tested on 2",
        "and 3 gloo ranks against one process. A class without a plan is refused by name.",
        "",
        "| VAE class | row-band decode / encode |",
        "|---|---|",
    ]
    for entry in registered(VAE):
        plan = VAE_PLANS.get(entry.class_name)
        cell = "✅ " + " ".join(plan.notes.split()) if plan is not None else "❌ not covered yet (refused by name)"
        lines.append(f"| `{entry.class_name.rpartition('.')[2]}` | {cell.replace('|', chr(92) + '|')} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/models.md differs from the registry")
    args = parser.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("docs/models.md is out of date: run python tools/models_table.py", file=sys.stderr)
            return 1
        return 0
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
