"""``fastdit serve``: an OpenAI-compatible image server over one accelerated :class:`~fastdit.session.Session`.

Layers, each importable without the ones above it:

- :mod:`fastdit.serve.limits`: :class:`Limits`, what a request may ask for and how much may wait;
- :mod:`fastdit.serve.schemas`: the request and response bodies (pydantic);
- :mod:`fastdit.serve.worker`: :class:`Job` (one request, ready to run on every rank), :class:`Runner` (runs jobs on
  a session), :class:`Driver` (rank 0: sends each job to every rank, then runs it) and :func:`worker_loop` (the other
  ranks of a ``torchrun`` job);
- :mod:`fastdit.serve.jobs`: :func:`~fastdit.serve.jobs.build_job`, the checks that need the model (size unit,
  limits, parameters the pipeline takes), and which jobs may share a batched call;
- :mod:`fastdit.serve.lora`: :class:`~fastdit.serve.lora.LoraSet`, the LoRA adapters of a pipeline through
  diffusers' LoRA API (all fused or all unfused; a failed change leaves them as they were);
- :mod:`fastdit.serve.inputs`: uploaded images, read and checked before queueing;
- :mod:`fastdit.serve.videos`: :class:`~fastdit.serve.videos.VideoStore`, video jobs and their mp4 files, bounded
  by age and count;
- :mod:`fastdit.serve.metrics`: the Prometheus metrics of one server;
- :mod:`fastdit.serve.app`: :func:`create_app`, the FastAPI application: auth, the bounded queue, the one consumer
  that runs the warm-up, then jobs and LoRA changes one at a time (or batched), errors as OpenAI's error object;
- :mod:`fastdit.serve.endpoints`: edits, video jobs, LoRA adapters and the web page (``static/index.html``).

The HTTP packages are an optional extra (``pip install fastdit[serve]``); :func:`require` names the one missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]

# Module name -> the distribution that provides it (what to pip install).
_PACKAGES = {
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "prometheus_client": "prometheus_client",
    "multipart": "python-multipart",
    "imageio": "imageio",
    "imageio_ffmpeg": "imageio-ffmpeg",
}


def require(module: str) -> ModuleType:
    """Import an optional dependency of the server.

    Args:
        module: The module to import (``"fastapi"``, ``"uvicorn"``, ``"prometheus_client"``).

    Returns:
        The module.

    Raises:
        ImportError: Naming the package to install and the extra that brings it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = _PACKAGES.get(module, module)
        raise ImportError(
            f"fastdit serve needs the package {package!r}: pip install {package} (or pip install 'fastdit[serve]')"
        ) from error
