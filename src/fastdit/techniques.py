"""The techniques fastdit applies, as one ordered tuple, :data:`TECHNIQUES`.

Each entry declares which request field turns it on, its checks (run for every requested technique before any
module is touched) and its ``apply`` (which records an undo, and any state it keeps, in the :class:`Context`).
:func:`fastdit.accelerate` walks the tuple in order; :func:`fastdit.disable` undoes the records in reverse.

The order is the *application* order: tensor parallel → projection fusion → quantization → the attention backend
(one device) → context parallel → the input check of the ranks that share a sample → CFG parallel → cache → offload
→ compile → CUDA graphs, then the text-encoder and VAE techniques on their own modules. Later entries may read
what earlier ones recorded (the cache reads the split layout's process groups through the runtime, graphs key block
calls on the split layout; quantization quantizes the fused groups). How the hooks of different techniques *nest*
on one module does not depend on this order: that is the layer table of :mod:`fastdit.hooks.layers`.

Adding a technique is one entry here plus its own module with an ``apply_<technique>(module, plan, config)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from fastdit.components.vae_technique import VaeParallel
from fastdit.errors import ArgumentError

if TYPE_CHECKING:
    from fastdit.components import Component, Components
    from fastdit.context import Context, Request

__all__ = ["TECHNIQUES", "Technique", "check_all", "check_request", "technique_names"]


class Technique(Protocol):
    """One technique: its name, when it is requested, its up-front checks and its application."""

    name: str
    needs_components: bool  # False: check() reads the request only (and runs before the target is walked)

    def requested(self, request: Request) -> bool:
        """Whether ``request`` asks for this technique."""
        ...

    def check(self, request: Request, components: Components) -> None:
        """Raise (``ValueError``/``NotImplementedError`` naming the field) if the request cannot be applied."""
        ...

    def apply(self, context: Context) -> None:
        """Apply to the context's components; record every undo in ``context`` as soon as it exists."""
        ...


class _TensorParallel:
    name = "tensor_parallel"
    needs_components = True

    def requested(self, request: Request) -> bool:
        return request.parallel is not None and request.parallel.tp > 1

    def check(self, request: Request, components: Components) -> None:
        from fastdit.parallel.tensor_parallel import check_unsplit
        from fastdit.parallel.tp_plan import resolve_tp_plan

        for item in components.denoisers:
            plan = item.adapter.tp_plan
            if plan is None:
                raise ArgumentError(
                    "accelerate",
                    "parallel",
                    request.parallel,
                    f"{item.name}: model family {item.adapter.family!r} has no tensor-parallel plan",
                )
            try:
                check_unsplit(item.module, plan)
                resolve_tp_plan(item.module, plan, request.parallel.tp, item.adapter.family)
            except ValueError as error:
                raise ArgumentError("accelerate", "parallel", request.parallel, f"{item.name}: {error}") from error

    def apply(self, context: Context) -> None:
        from fastdit.parallel.tensor_parallel import apply_tensor_parallel

        runtime = context.runtime
        for item in context.components.denoisers:
            applied = apply_tensor_parallel(
                item.module,
                item.adapter.tp_plan,
                runtime.mesh["tp"],
                device=runtime.device,
                family=item.adapter.family,
            )
            context.add(self.name, item.name, applied.undo, applied.state)


def _run_device(request: Request, module: torch.nn.Module) -> torch.device:
    """Where ``module`` will compute: its parameters' device, the accelerator tensor parallelism moves it to, or the
    device offload streams it to."""
    param = next(module.parameters(), None)
    device = torch.device("cpu") if param is None else param.device
    if request.offload is not None:  # a pipeline loaded on the CPU computes on the GPU its blocks are streamed to
        from fastdit.offload import offload_device

        return offload_device(request.offload, device)
    split = request.parallel is not None and request.parallel.tp > 1
    if split and device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # as the runtime places a CPU-loaded pipeline
    return device


class _Fuse:
    """Projections that share an input fused into one matmul per group; before quantization, which then quantizes
    each group's layer instead of its members."""

    name = "fuse"
    needs_components = True

    def requested(self, request: Request) -> bool:
        return request.fuse is not None

    def check(self, request: Request, components: Components) -> None:
        from fastdit.fuse import plan_groups

        config = request.fuse
        others = {
            "parallel": request.parallel if request.parallel is not None and request.parallel.tp > 1 else None,
            "offload": request.offload,
        }
        given = {name: value for name, value in others.items() if value is not None}
        if given:
            name, value = next(iter(given.items()))
            why = {
                "parallel": "tensor parallelism splits each projection on its own (DTensor weights)",
                "offload": "offload streams each block's registered parameters, and a group's weights are held apart",
            }[name]
            raise ArgumentError(
                "accelerate", "fuse", config, f"with {name}={value}: {why}; use one of them (fusion is for one device)"
            )
        for item in components.denoisers:
            declared = item.adapter.fused_projections
            if not declared:
                raise ArgumentError(
                    "accelerate",
                    "fuse",
                    config,
                    f"{item.name}: model family {item.adapter.family!r} declares no projections that share an input",
                )
            try:
                plan_groups(item.module, declared, config)
            except ValueError as error:
                raise ArgumentError("accelerate", "fuse", config, f"{item.name}: {error}") from error

    def apply(self, context: Context) -> None:
        from fastdit.fuse import apply_fuse

        for item in context.components.denoisers:
            applied = apply_fuse(item.module, item.adapter.fused_projections, context.request.fuse)
            context.add(self.name, item.name, applied.undo, applied.state)


class _Quantize:
    """torchao quantization of the Linear layers in the blocks; after tensor parallelism, which splits plain weights
    (it quantizes each rank's slice), and before compile, which traces the quantized matmuls."""

    name = "quantize"
    needs_components = True

    def requested(self, request: Request) -> bool:
        return request.quantize is not None

    def check(self, request: Request, components: Components) -> None:
        from fastdit.quantize import check_quantize

        if request.offload is not None:
            raise ArgumentError(
                "accelerate",
                "quantize",
                request.quantize,
                f"with offload={request.offload}: offload streams plain weights from pinned host memory, and the "
                "quantized ones are torchao tensors it does not copy; use one of them (weight-only quantization "
                "also saves memory)",
            )
        if request.quantize.calibrate:
            _check_recording(request, "quantize", request.quantize)
        for item in components.denoisers:
            dtype = next((p.dtype for p in item.module.parameters() if p.is_floating_point()), None)
            try:
                check_quantize(request.quantize, _run_device(request, item.module), dtype)
            except ValueError as error:
                raise ArgumentError("accelerate", "quantize", request.quantize, f"{item.name}: {error}") from error
            if request.quantize.scales is not None:
                self._check_scales(request, item)

    @staticmethod
    def _check_scales(request: Request, item: Component) -> None:
        from fastdit.cache.magcache import model_name
        from fastdit.quantize import static_coverage

        scales = request.quantize.scales
        model = model_name(item.module)
        covered, _missing = static_coverage(item.module, request.quantize, _block_paths(item), item.name)
        if model not in scales.model.split("; ") or not covered:
            raise ArgumentError(
                "accelerate",
                "quantize",
                request.quantize,
                f"{item.name} is {model}, and the scales were recorded on {scales.model} "
                f"({len(covered)} of their layers are its): record them on this model",
            )

    def apply(self, context: Context) -> None:
        from fastdit.quantize import apply_quantize

        for item in context.components.denoisers:
            fused = context.state("fuse", item.name)
            groups = () if fused is None else fused.groups
            applied = apply_quantize(item.module, context.request.quantize, _block_paths(item), item.name, groups)
            context.add(self.name, item.name, applied.undo, applied.state)


def _check_recording(request: Request, field: str, value: object) -> None:
    """Refuse a recording run (``calibrate=True``) beside what would keep calls from being recorded."""
    # Replayed graphs and compiled code would not call the recording hooks every step; a cache skips blocks.
    others = {"compile": request.compile, "cuda_graph": request.cuda_graph, "cache": request.cache}
    given = [f"{name}={other!r}" for name, other in others.items() if other is not None]
    if given:
        raise ArgumentError(
            "accelerate",
            field,
            value,
            f"calibrate=True records every layer's input on plain eager calls; with {', '.join(given)} some "
            "calls would not be recorded: calibrate without them",
        )


def _block_paths(item: Component) -> tuple[str, ...]:
    """The dotted paths of a denoiser's block lists ('*' paths made concrete; interleaved lists too)."""
    from fastdit.models.validate import concrete_groups

    groups = concrete_groups(item.module, item.adapter.block_groups)
    return tuple(g.path for g in groups) + tuple(g.interleaved.path for g in groups if g.interleaved)


class _AttentionBackend:
    """An attention backend for every SDPA call of the transformer on one device (under context parallelism the
    backend is the context-parallel attention's local kernel instead)."""

    name = "attention"
    needs_components = True

    def requested(self, request: Request) -> bool:
        from fastdit.config import Attention

        return request.attention is not None and request.attention != Attention() and not request.context_parallel

    def check(self, request: Request, components: Components) -> None:
        from fastdit.parallel.attention.single import check_attention_backend

        if request.attention.calibrate:
            _check_recording(request, "attention", request.attention)
        for item in components.denoisers:
            routing = item.adapter.cp_plan.attention if item.adapter.cp_plan is not None else None
            device = _run_device(request, item.module)
            try:
                check_attention_backend(request.attention, device, routing, compiled=request.compile is not None)
            except ValueError as error:
                raise ArgumentError("accelerate", "attention", request.attention, f"{item.name}: {error}") from error
            if request.attention.scales is not None:
                self._check_scales(request, item)

    @staticmethod
    def _check_scales(request: Request, item: Component) -> None:
        from fastdit.cache.magcache import model_name
        from fastdit.parallel.attention.single import attention_sites

        scales = request.attention.scales
        table = scales.lookup()
        covered = [name for name in attention_sites(item.module, item.name) if name in table]
        model = model_name(item.module)
        if model not in scales.model.split("; ") or not covered:
            raise ArgumentError(
                "accelerate",
                "attention",
                request.attention,
                f"{item.name} is {model}, and the scales were recorded on {scales.model} with "
                f"{len(covered)} attention inputs of its modules: record them on this model "
                "(fastdit.calibration.calibrate_scales records the attention inputs beside the Linear layers')",
            )

    def apply(self, context: Context) -> None:
        from fastdit.parallel.attention.single import apply_attention_backend

        request = context.request
        for item in context.components.denoisers:
            routing = item.adapter.cp_plan.attention if item.adapter.cp_plan is not None else None
            applied = apply_attention_backend(
                item.module, request.attention, routing, component=item.name, device=_run_device(request, item.module)
            )
            context.add(self.name, item.name, applied.undo, applied.state)


class _ContextParallel:
    name = "context_parallel"
    needs_components = True

    def requested(self, request: Request) -> bool:
        return request.context_parallel

    def check(self, request: Request, components: Components) -> None:
        from fastdit.parallel.plan import validate_plan

        attention = request.attention
        if attention is not None and (attention.scales is not None or attention.calibrate):
            raise ArgumentError(
                "accelerate",
                "attention",
                attention,
                f"with parallel={request.parallel}: static attention scales and their calibration are per attention "
                "module on one device; under context parallelism the attention of every module runs through one "
                "exchange with dynamic scales (record the scales, and run them, without context parallelism)",
            )
        for item in components.denoisers:
            plan = item.adapter.cp_plan
            if plan is None:
                raise ArgumentError(
                    "accelerate",
                    "parallel",
                    request.parallel,
                    f"{item.name}: model family {item.adapter.family!r} has no context-parallel plan",
                )
            try:
                validate_plan(item.module, plan, request.parallel.ulysses, tp_degree=request.parallel.tp)
            except ValueError as error:
                raise ArgumentError("accelerate", "parallel", request.parallel, f"{item.name}: {error}") from error
            if request.cuda_graph is not None and plan.attention.exchange_lengths:
                raise ArgumentError(
                    "accelerate",
                    "cuda_graph",
                    request.cuda_graph,
                    f"with parallel={request.parallel}: {item.name} ({item.adapter.family}) exchanges attention "
                    "lengths that depend on the data at every call, which a CUDA graph would freeze; run without "
                    "CUDA graphs",
                )

    def apply(self, context: Context) -> None:
        from fastdit.parallel.context_parallel import apply_context_parallel

        request = context.request
        for item in context.components.denoisers:
            applied = apply_context_parallel(
                item.module,
                item.adapter.cp_plan,
                request.parallel,
                context.runtime,
                attention=request.attention,
                family=item.adapter.family,
            )
            context.add(self.name, item.name, applied.undo, applied.state)


class _InputCheck:
    """Equal inputs on the ranks that compute one sample, checked at each run's first transformer call."""

    name = "input_check"
    needs_components = True

    def requested(self, request: Request) -> bool:
        return request.shares_samples

    def check(self, request: Request, components: Components) -> None:
        pass  # nothing can be wrong before the first call

    def apply(self, context: Context) -> None:
        from fastdit.cache.runs import reset_on_new_schedule
        from fastdit.parallel.input_check import install_input_check

        runtime = context.runtime
        group = None if runtime is None else runtime.sample_group()
        if group is None:  # one rank per sample after all: nothing to compare
            return
        hooks = []
        for item in context.components.denoisers:
            hook, undo = install_input_check(item.module, group, runtime.device, item.name)
            context.add(self.name, item.name, undo, hook)
            hooks.append(hook)
        # A call that raised never reaches the pipeline's end-of-call reset: the next one's schedule starts a run.
        undo = reset_on_new_schedule(context.components.pipeline, hooks)
        if undo is not None:
            context.add("input_check.runs", "scheduler", undo)


class _CfgParallel:
    """The guidance branches (or the CFG batch) of each transformer call over the ``cfg`` ranks."""

    name = "cfg_parallel"
    needs_components = True

    def requested(self, request: Request) -> bool:
        return request.parallel is not None and request.parallel.cfg > 1

    def check(self, request: Request, components: Components) -> None:
        import inspect

        pipeline = components.pipeline
        for item in components.denoisers:
            if not item.adapter.cfg_parallel:
                notes = " ".join(item.adapter.notes.split())
                reason = (
                    notes.split("No CFG parallelism:", 1)[1].split(". ")[0].strip(" .")
                    if "No CFG parallelism:" in notes
                    else ""
                )
                raise ArgumentError(
                    "accelerate",
                    "parallel",
                    request.parallel,
                    f"{item.name}: CFG parallelism is not available for model family {item.adapter.family!r}"
                    + (f" ({reason})" if reason else ""),
                )
        from fastdit import modular

        if modular.is_modular(pipeline):
            # A ModularPipeline's call takes its blocks' inputs; a guider component runs the branches itself
            # (MiniMax Music 3 takes no guidance scale, its guider holds it).
            params = modular.call_parameters(pipeline)
            guided = getattr(pipeline, "guider", None) is not None
        else:
            params = inspect.signature(type(pipeline).__call__).parameters if callable(pipeline) else {}
            guided = False
        if not guided and not {"negative_prompt", "negative_prompt_embeds", "guidance_scale", "true_cfg_scale"} & set(
            params
        ):
            what = type(pipeline).__name__ if pipeline is not None else "a bare transformer"
            raise ArgumentError(
                "accelerate",
                "parallel",
                request.parallel,
                f"cfg=2 splits the conditional and unconditional branches of classifier-free guidance, and {what} "
                "takes no guidance (no negative prompt, no guidance scale, no guider)",
            )

    def apply(self, context: Context) -> None:
        from fastdit.cache.runs import reset_on_new_schedule
        from fastdit.parallel.cfg_parallel import apply_cfg_parallel, apply_cfg_parallel_branches

        runtime = context.runtime
        hooks = []
        per_branch = [item for item in context.components.denoisers if item.name in item.adapter.cfg_branch_components]
        if per_branch:  # one denoiser per guidance branch: one hook pairs their calls
            branches = [(item.module, item.adapter.cfg_branch_components[item.name]) for item in per_branch]
            cfg = (runtime.group("cfg"), runtime.coordinate("cfg"), runtime.size("cfg"), runtime.device)
            for item, applied in zip(per_branch, apply_cfg_parallel_branches(branches, *cfg), strict=True):
                context.add(self.name, item.name, applied.undo, applied.state)
            hooks.append(applied.state)
        for item in context.components.denoisers:
            if item.name in item.adapter.cfg_branch_components:
                continue
            applied = apply_cfg_parallel(
                item.module,
                runtime.group("cfg"),
                runtime.coordinate("cfg"),
                runtime.size("cfg"),
                runtime.device,
                item.adapter.cfg_batch_dims,
                item.adapter.timestep_arg,
                item.adapter.cfg_pairs_by_timestep,
                item.adapter.unstepped_calls,
            )
            context.add(self.name, item.name, applied.undo, applied.state)
            hooks.append(applied.state)
        undo = reset_on_new_schedule(context.components.pipeline, hooks)
        if undo is not None:
            context.add("cfg_parallel.runs", "scheduler", undo)


class _Cache:
    needs_components = True
    name = "cache"

    def requested(self, request: Request) -> bool:
        return request.cache is not None

    def check(self, request: Request, components: Components) -> None:
        from fastdit.cache.hooks import plan_slots
        from fastdit.cache.magcache import check_denoisers
        from fastdit.config import MagCache
        from fastdit.models.validate import block_lists, check_adapter, resolve_interleaved

        cache = request.cache
        if getattr(cache, "calibrate", False) and request.parallel is not None and request.parallel.cfg > 1:
            # Each CFG rank runs one guidance branch's calls: MagCache would record one branch's ratios per rank and
            # TeaCache fit a different polynomial on each rank, from one branch's pairs.
            raise ArgumentError(
                "accelerate",
                "cache",
                cache,
                f"calibrate=True with parallel={request.parallel}: a CFG rank computes one guidance branch, so it "
                "cannot record the other's; calibrate without cfg (context and tensor parallelism record what one "
                "process does), then use the calibration under cfg",
            )
        for item in components.denoisers:
            check_adapter(item.module, item.adapter)
            resolve_interleaved(item.module, item.adapter.block_groups, item.adapter.family)
            groups = block_lists(item.module, item.adapter)
            where = (item.name, type(item.module).__name__)
            plan_slots(groups, cache.fn, cache.bn, owner=type(cache).__name__, where=where)
        if isinstance(cache, MagCache):  # a calibration per denoiser, for exactly the pipeline's denoisers
            check_denoisers(cache, [item.name for item in components.denoisers])

    def apply(self, context: Context) -> None:
        from fastdit.cache import apply_cache
        from fastdit.cache.magcache import denoiser_config
        from fastdit.cache.runs import reset_on_new_schedule
        from fastdit.config import MagCache

        trackers = []
        for item in context.components.denoisers:
            reducer = context.cache_reducer(item.name)
            config = context.request.cache
            if isinstance(config, MagCache):  # each denoiser skips by its own calibration
                config = denoiser_config(config, item.name)
            applied = apply_cache(item.module, item.adapter.cache_plan, config, reducer=reducer)
            context.add(self.name, item.name, applied.undo, applied.state)
            trackers.append(applied.state.tracker)
            if item.adapter.patch is not None:  # the family's PatchFunctor, active while a cache is installed
                context.add("patch", item.name, item.adapter.patch(item.module))
        undo = reset_on_new_schedule(context.components.pipeline, trackers)
        if undo is not None:
            context.add("cache.runs", "scheduler", undo)


class _Offload:
    """Transformer blocks streamed from host memory (after every technique whose hooks may skip a block)."""

    needs_components = True
    name = "offload"

    def requested(self, request: Request) -> bool:
        return request.offload is not None

    def check(self, request: Request, components: Components) -> None:
        import torch

        config = request.offload
        if request.parallel is not None and request.parallel.tp > 1:
            raise ArgumentError(
                "accelerate",
                "offload",
                config,
                f"with parallel={request.parallel}: tensor parallelism shards the weights across ranks, which "
                "already divides their memory; offload streams whole weights from host memory: use one of them",
            )
        if request.cuda_graph is not None:
            raise ArgumentError(
                "accelerate",
                "offload",
                config,
                f"with cuda_graph={request.cuda_graph}: a CUDA graph replays fixed weight addresses, and offload "
                "copies each block's weights to new memory at every call; run without CUDA graphs",
            )
        if config.device is not None and torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
            raise ArgumentError("accelerate", "offload", config, f"device={config.device!r}: no CUDA device here")
        for item in components.denoisers:
            count = len(item.blocks())
            if config.resident_blocks >= count:
                raise ArgumentError(
                    "accelerate",
                    "offload",
                    config,
                    f"{item.name} has {count} blocks: resident_blocks={config.resident_blocks} leaves none to "
                    "stream; keep fewer resident, or run without offload",
                )

    def apply(self, context: Context) -> None:
        from fastdit.offload import apply_offload, move_components, offload_device

        config = context.request.offload
        first = next(context.components.denoisers[0].module.parameters())
        device = offload_device(config, first.device)
        for item in context.components.denoisers:
            applied = apply_offload([block for _, block in item.blocks()], config, device)
            context.add(self.name, item.name, applied.undo, applied.state)
        # Everything else computes on the device too (placeholders of the streamed blocks are there already).
        context.add("offload.devices", "pipeline", move_components(context.components, device))


class _Compile:
    needs_components = True
    name = "compile"

    def requested(self, request: Request) -> bool:
        return request.compile is not None

    def check(self, request: Request, components: Components) -> None:
        # Compile validates its own fields; graph breaks surface at the first call.
        if request.compile.vae:
            _check_vae_compile(request, components)

    def apply(self, context: Context) -> None:
        from fastdit.compile import apply_compile, apply_vae_compile, outer_modules
        from fastdit.components.registry import VAE

        config = context.request.compile
        for item in context.components.denoisers:
            blocks = item.blocks()
            modules = [block for _, block in blocks]
            if config.outer:
                modules += [module for _, module in outer_modules(item.module, [name for name, _ in blocks])]
            context.add(self.name, item.name, apply_compile(modules, config).undo)
        if context.request.compile.vae:
            for item in context.components.of(VAE):
                context.add("compile.vae", item.name, apply_vae_compile([item.module], context.request.compile).undo)


def _check_vae_compile(request: Request, components: Components) -> None:
    """``Compile(vae=True)`` needs VAEs with a decoder module, and no VAE parallelism around their layers."""
    from fastdit.compile import vae_decoder
    from fastdit.components.registry import VAE

    config = request.compile
    if request.parallel is not None and request.parallel.vae:
        raise ArgumentError(
            "accelerate",
            "compile",
            config,
            "Compile(vae=True) with Parallel(vae=True): the parallel decode exchanges row halos between the decoder's "
            "layers, which a compiled decoder would trace through; compile the blocks only (vae=False) or decode "
            "without VAE parallelism",
        )
    vaes = components.of(VAE)
    if not vaes:
        raise ArgumentError(
            "accelerate", "compile", config, f"Compile(vae=True): {components.owner} has no VAE fastdit knows"
        )
    for item in vaes:
        if vae_decoder(item.module) is None:
            cls = type(item.module)
            raise ArgumentError(
                "accelerate",
                "compile",
                config,
                f"Compile(vae=True): {item.name} ({cls.__qualname__}) has no `decoder` module to compile",
            )


class _CudaGraph:
    needs_components = True
    name = "cuda_graph"

    def requested(self, request: Request) -> bool:
        return request.cuda_graph is not None

    def check(self, request: Request, components: Components) -> None:
        from fastdit.cuda_graph import resolve_scope

        config = request.cuda_graph
        if config.scope == "call" and request.cache is not None:
            raise ArgumentError(
                "accelerate",
                "cuda_graph",
                config,
                f"with cache={request.cache}: a step cache decides on the host between blocks, which a CUDA graph of "
                "the whole call cannot do; use scope='blocks' or 'auto'",
            )
        if resolve_scope(config, request.cache is not None) != "call":
            return
        for item in components.denoisers:
            reading = item.adapter.host_reading_modules
            if reading:
                raise ArgumentError(
                    "accelerate",
                    "cuda_graph",
                    config,
                    f"{item.name} ({item.adapter.family}): its {', '.join(reading)} read tensor values on the host "
                    "at every call, which a CUDA graph of the whole call would freeze; use scope='blocks' (each "
                    "block graphed, those modules eager)",
                )

    def apply(self, context: Context) -> None:
        from fastdit.cuda_graph import apply_cuda_graph

        for item in context.components.denoisers:
            layout = context.state("context_parallel", item.name)
            applied = apply_cuda_graph(
                item.module,
                context.request.cuda_graph,
                blocks=item.blocks(),
                cached=context.request.cache is not None,
                context_key=None if layout is None else layout.signature,
            )
            context.add(self.name, item.name, applied.undo, applied.state)


class _TextEncoderParallel:
    """Tensor parallelism of every text encoder over all ranks of the job (each rank encodes the same prompts)."""

    name = "text_encoder_parallel"
    needs_components = True

    def requested(self, request: Request) -> bool:
        return request.parallel is not None and request.parallel.text_encoder

    def check(self, request: Request, components: Components) -> None:
        from fastdit.components.registry import TEXT_ENCODER
        from fastdit.components.text_encoders import text_encoder_plan
        from fastdit.parallel.tensor_parallel import check_unsplit
        from fastdit.parallel.tp_plan import resolve_tp_plan

        parallel = request.parallel
        degree = parallel.world_size
        if degree == 1:
            raise ArgumentError(
                "accelerate",
                "parallel",
                parallel,
                "text_encoder=True splits the text encoders over all ranks of the job, and this layout has one rank "
                "(world size 1): there is nothing to split over; run on several processes or drop text_encoder",
            )
        encoders = components.of(TEXT_ENCODER)
        if not encoders:
            raise ArgumentError(
                "accelerate", "parallel", parallel, "text_encoder=True: the target has no text encoder to split"
            )
        for item in encoders:
            try:
                plan = text_encoder_plan(item.module)
                check_unsplit(item.module, plan)
                resolve_tp_plan(item.module, plan, degree, type(item.module).__name__)
            except ValueError as error:
                # The plan's messages say "tp": here the degree is the world size, every rank of the job.
                raise ArgumentError(
                    "accelerate",
                    "parallel",
                    parallel,
                    f"text_encoder=True splits the text encoders over all {degree} ranks: {item.name}: {error}",
                ) from error

    def apply(self, context: Context) -> None:
        from fastdit.components.registry import TEXT_ENCODER
        from fastdit.components.text_encoders import text_encoder_plan
        from fastdit.parallel.tensor_parallel import apply_tensor_parallel

        runtime = context.runtime
        mesh = runtime.world_mesh()
        for item in context.components.of(TEXT_ENCODER):
            applied = apply_tensor_parallel(
                item.module,
                text_encoder_plan(item.module),
                mesh,
                device=runtime.device,
                family=type(item.module).__name__,
            )
            context.add(self.name, item.name, applied.undo, applied.state)


TECHNIQUES: tuple[Technique, ...] = (
    _TensorParallel(),
    _Fuse(),
    _Quantize(),
    _AttentionBackend(),
    _ContextParallel(),
    _InputCheck(),
    _CfgParallel(),
    _Cache(),
    _Offload(),
    _Compile(),
    _CudaGraph(),
    _TextEncoderParallel(),
    VaeParallel(),
)
"""Every technique, in application order."""


def technique_names() -> tuple[str, ...]:
    """The names of :data:`TECHNIQUES`, in order."""
    return tuple(t.name for t in TECHNIQUES)


def check_request(request: Request) -> None:
    """Run the checks that need only the request (before the target is looked at)."""
    for technique in TECHNIQUES:
        if technique.requested(request) and not technique.needs_components:
            technique.check(request, None)


def check_all(request: Request, components: Components) -> list[Technique]:
    """Run the checks of every requested technique (nothing is touched); return them in application order."""
    requested = [t for t in TECHNIQUES if t.requested(request)]
    for technique in requested:
        if technique.needs_components:
            technique.check(request, components)
    return requested
