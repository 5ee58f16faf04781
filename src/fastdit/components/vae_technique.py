"""The ``Parallel(vae=True)`` technique: every VAE of the pipeline decodes (and encodes) by row bands over all ranks.

Its checks run before any module is touched: the layout has more than one rank, the target has a VAE, every VAE's
exact class has a plan (:mod:`fastdit.components.vae_plans`) that covers each of its row-mixing modules, and no VAE
decodes by tiles. The bands span every rank of the job (the group of all mesh dims), whatever the other techniques
do with them: the VAE runs after the denoising loop, when every rank holds the same latents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastdit.errors import ArgumentError, UnavailableError

if TYPE_CHECKING:
    from fastdit.components import Components
    from fastdit.context import Context, Request

__all__ = ["VaeParallel"]


class VaeParallel:
    """The VAE-parallel entry of :data:`fastdit.techniques.TECHNIQUES`."""

    name = "vae_parallel"
    needs_components = True

    def requested(self, request: Request) -> bool:
        """Whether ``request`` sets ``Parallel(vae=True)``."""
        return request.parallel is not None and request.parallel.vae

    def check(self, request: Request, components: Components) -> None:
        """Refuse (naming the field) a single rank, a target without a VAE, a VAE without a plan or with tiling on."""
        from fastdit.components.registry import VAE
        from fastdit.components.vae_parallel import check_vae
        from fastdit.components.vae_plans import plan_for

        parallel = request.parallel
        if parallel.world_size < 2:
            raise ArgumentError(
                "accelerate",
                "parallel",
                parallel,
                "vae=True splits the VAE's decode over the ranks of the job, and this layout has one "
                "(world_size = cfg × ring × ulysses × tp = 1); launch several processes with a degree > 1",
            )
        vaes = components.of(VAE)
        if not vaes:
            raise ArgumentError(
                "accelerate", "parallel", parallel, f"vae=True: {components.owner} has no VAE fastdit knows"
            )
        for item in vaes:
            plan = plan_for(item.module)
            cls = type(item.module)
            if plan is None:
                raise UnavailableError(
                    "accelerate",
                    "parallel",
                    parallel,
                    f"vae=True: {item.name} ({cls.__module__}.{cls.__qualname__}) has no VAE-parallel plan yet "
                    "(docs/vae_parallel.md lists the covered classes)",
                )
            try:
                check_vae(item.module, plan)
            except ValueError as error:
                raise ArgumentError("accelerate", "parallel", parallel, f"vae=True: {item.name}: {error}") from error

    def apply(self, context: Context) -> None:
        """Wrap every VAE over the group of all ranks; record each undo and its statistics."""
        from fastdit.components.registry import VAE
        from fastdit.components.vae_parallel import apply_vae_parallel
        from fastdit.components.vae_plans import plan_for
        from fastdit.parallel.runtime import MESH_DIMS

        group = context.runtime.flat_group(MESH_DIMS)
        for item in context.components.of(VAE):
            applied = apply_vae_parallel(item.module, plan_for(item.module), group)
            context.add(self.name, item.name, applied.undo, applied.state)
