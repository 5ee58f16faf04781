"""Family files are leaves: loading the registry imports no test fixture.

The tiny pipelines' builders and deferred call arguments import :mod:`fastdit.testing` when they run; importing a
family file (which the registry does for every family on first lookup) must not.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import fastdit
from fastdit.models._lazy import Deferred, LazyKwargs, tiny_image
from fastdit.models.registry import all_adapters

# Run in a fresh interpreter: this test process has imported fixtures long before the test runs.
_PROBE = textwrap.dedent(
    """
    import importlib
    import json
    import sys

    def fixtures():
        return {m for m in sys.modules if m == "fastdit.testing" or m.startswith("fastdit.testing.")}

    import fastdit
    from fastdit.models import registry

    offenders = {}
    if fixtures():
        offenders["fastdit.models.registry"] = sorted(fixtures())
    # One family at a time, so a failure names the file whose import pulled fixtures in (the first one only:
    # a fixture module already imported is not seen again).
    for name in registry.family_modules():
        before = fixtures()
        importlib.import_module(f"fastdit.models.{name}")
        if fixtures() - before:
            offenders[f"fastdit.models.{name}"] = sorted(fixtures() - before)
    # Every lookup the engine and the CLI make, down to the names of each tiny pipeline's call arguments.
    before = fixtures()
    for adapter in registry.all_adapters():
        for tiny in adapter.tiny_pipelines:
            list(tiny.call_kwargs)
    registry.all_presets()
    if fixtures() - before:
        offenders["registry lookups"] = sorted(fixtures() - before)
    print(json.dumps({"families": len(registry.all_adapters()), "offenders": offenders}))
    """
)


def test_loading_every_adapter_imports_no_fixture() -> None:
    src = str(Path(fastdit.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=240, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["families"] == len(all_adapters())
    assert report["offenders"] == {}, f"fastdit.testing imported at module level by: {report['offenders']}"


def test_call_kwargs_resolve_every_deferred_value() -> None:
    # A Deferred left in a plain dict would reach the pipeline as-is: every one must sit in a LazyKwargs.
    for adapter in all_adapters():
        for tiny in adapter.tiny_pipelines:
            kwargs = {**tiny.call_kwargs}
            left = [key for key, value in kwargs.items() if isinstance(value, Deferred)]
            assert not left, f"{adapter.family}/{tiny.name}: call_kwargs {left} are not in a LazyKwargs"


def test_lazy_kwargs_build_once_and_pickle() -> None:
    from PIL import Image

    kwargs = LazyKwargs({"prompt": "a cat", "image": tiny_image(8)})
    assert kwargs["image"] is kwargs["image"]  # one object per key, as an eagerly built value would be
    assert isinstance(kwargs["image"], Image.Image) and kwargs["image"].size == (8, 8)
    restored = pickle.loads(pickle.dumps(kwargs))
    assert restored["prompt"] == "a cat"
    assert restored["image"].tobytes() == kwargs["image"].tobytes()


def test_wan_latent_channels_match_the_tiny_vae() -> None:
    # Cosmos and SkyReels-V2 spell the Wan VAE's latent channel count as a literal so they need not import it.
    from fastdit.models import cosmos, skyreels_v2
    from fastdit.testing.components.autoencoder_kl_wan import WAN_LATENT_CHANNELS

    assert cosmos._LATENT == skyreels_v2._Z_DIM == WAN_LATENT_CHANNELS
