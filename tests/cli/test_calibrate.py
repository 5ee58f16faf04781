"""``fastdit calibrate``: a configuration chosen for a target on calibration seeds, checked on held-out seeds, stored
in a file that ``--cache from:PATH`` and ``--cache calibrated`` read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fastdit.cache.files import CacheFile, load_cache_file, save_cache_file
from fastdit.cli import CLIError, main
from fastdit.cli.options import cache_from_spec
from fastdit.config import DBCache, MagCache, TaylorSeer, TeaCache
from fastdit.session import Session

pytestmark = pytest.mark.usefixtures("single_process")

# The reference pipeline (trained: its caches hit) at 12 steps, 2 prompts, one calibration and one held-out seed.
SMALL = ["--steps", "12", "--prompts", "2", "--seeds", "0", "--heldout-seeds", "101", "--quiet"]


def _last_json(text: str) -> dict[str, Any]:
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture
def calibration_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "calibrations"
    monkeypatch.setenv("FASTDIT_CALIBRATION_DIR", str(directory))
    return directory


def test_calibrate_then_generate_from_the_file(calibration_dir: Path, capsys: Any) -> None:
    assert main(["calibrate", "--target-psnr", "30", *SMALL, "--json"]) == 0
    captured = capsys.readouterr()
    path = calibration_dir / "reference-12steps.json"  # the default file of --cache calibrated
    payload = _last_json(captured.out)
    assert payload["path"] == str(path)
    assert "Chosen:" in captured.err and "| held-out |" in captured.err and "| calibration |" in captured.err
    loaded = load_cache_file(path, num_steps=12)
    assert isinstance(loaded.config, (DBCache, MagCache)) and loaded.model == "reference"
    chosen = loaded.provenance["calibration"]
    assert chosen["psnr_min"] >= 31 and chosen["ssim_min"] >= 0.9 and chosen["blocks_computed_fraction"] < 1
    assert loaded.provenance["heldout"]["name"] == chosen["name"]  # the same configuration, on unseen seeds
    candidates = loaded.provenance["candidates"]
    assert chosen["name"] in [c["name"] for c in candidates]
    assert all(c["blocks_computed_fraction"] >= chosen["blocks_computed_fraction"]
               for c in candidates if c["psnr_min"] >= 31 and c["ssim_min"] >= 0.9)  # fmt: skip

    for spec in ("calibrated", f"from:{path}"):
        assert (
            main(["generate", "--steps", "12", "--cache", spec, "--json", "--out", str(calibration_dir / "x.png")]) == 0
        )
        out = _last_json(capsys.readouterr().out)
        assert out["acceleration"]["cache"]["type"] == type(loaded.config).__name__
        assert out["acceleration"]["cache"]["threshold"] == loaded.config.threshold
        assert out["blocks_computed_fraction"] < 1

    assert main(["generate", "--steps", "10", "--cache", "calibrated", "--out", str(calibration_dir / "y.png")]) == 2
    err = capsys.readouterr().err
    assert "no calibration of 'reference' for 10 steps" in err and "fastdit calibrate" in err
    assert main(["generate", "--steps", "10", "--cache", f"from:{path}", "--out", str(calibration_dir / "y.png")]) == 2
    assert "chosen on runs of num_steps=12, asked to serve num_steps=10" in capsys.readouterr().err


@pytest.mark.slow  # the same search as the PSNR target's, to its other stopping rule (tests/bench covers both)
def test_speedup_target(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "fast.json"
    assert main(["calibrate", "--target-speedup", "2", "--policies", "dbcache", *SMALL, "--out", str(out)]) == 0
    loaded = load_cache_file(out)
    assert isinstance(loaded.config, DBCache) and loaded.provenance["calibration"]["blocks_computed_fraction"] <= 0.5


@pytest.mark.slow
def test_teacache_policy_fits_its_polynomial_and_generates_from_the_file(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "tea.json"
    assert main(["calibrate", "--target-speedup", "2", "--policies", "teacache", *SMALL, "--out", str(out)]) == 0
    loaded = load_cache_file(out, num_steps=12)
    assert isinstance(loaded.config, TeaCache) and len(loaded.config.calibration.coefficients) == 5
    assert loaded.provenance["calibration"]["blocks_computed_fraction"] <= 0.5
    image = tmp_path / "x.png"
    assert main(["generate", "--steps", "12", "--cache", f"from:{out}", "--json", "--out", str(image)]) == 0
    assert _last_json(capsys.readouterr().out)["acceleration"]["cache"]["type"] == "TeaCache"


def test_spectral_policy_is_skipped_for_a_family_without_a_latent_grid(tmp_path: Path, capsys: Any) -> None:
    """The reference pipeline is a FLUX: its latent arrives packed into tokens, so only the spectral policy asked
    for leaves nothing to search (exit 2, nothing written)."""
    out = tmp_path / "spectral.json"
    argv = ["calibrate", "--target-speedup", "2", "--policies", "spectral", *SMALL, "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "spectral skipped: a denoiser's family declares no latent grid" in err and not out.exists()
    assert "argument --policies: no policy can apply" in err


@pytest.mark.slow
def test_unreachable_target_writes_nothing(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "never.json"
    argv = ["calibrate", "--target-speedup", "50", "--policies", "dbcache", *SMALL, "--out", str(out)]
    assert main(argv) == 1
    assert "No configuration met the target." in capsys.readouterr().out and not out.exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--target-speedup", "0.5"], "argument --target-speedup: Target.speedup=0.5"),
        (["--target-psnr", "30", "--ssim-min", "1.5"], "argument --ssim-min"),
        (["--target-psnr", "30", "--margin", "-1"], "argument --margin"),
        (["--target-psnr", "30", "--policies", "fastercache"], "argument --policies fastercache"),
        (["--target-psnr", "30", "--policies", "dbcache,dbcache"], "argument --policies"),
        (["--target-psnr", "30", "--heldout-seeds", "0"], "seeds [0] are calibration seeds too"),
        (["--target-psnr", "30", "--seeds", "x"], "argument --seeds x"),
        (["--target-psnr", "30", "--prompts", "0"], "--prompts"),
    ],
)
def test_bad_input_exits_2_before_loading(
    argv: list[str], needle: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Session, "load", lambda *_, **__: pytest.fail("loaded before checking the arguments"))
    assert main(["calibrate", *argv, "--out", str(tmp_path / "c.json")]) == 2
    assert needle in capsys.readouterr().err


def test_one_target_is_required(capsys: Any) -> None:
    for argv, needle in (([], "is required"), (["--target-psnr", "30", "--target-speedup", "2"], "not allowed")):
        assert main(["calibrate", *argv]) == 2
        assert needle in capsys.readouterr().err


def test_file_specs_take_field_overrides(tmp_path: Path) -> None:
    config = DBCache(fn=1, bn=0, threshold=0.3, taylorseer=TaylorSeer(order=2, variable="timestep"))
    path = save_cache_file(tmp_path / "c.json", CacheFile(config, "flux", 28))
    assert cache_from_spec(f"from:{path}", 28) == config
    assert cache_from_spec(f"from:{path},threshold=0.5", 28) == DBCache(
        fn=1, bn=0, threshold=0.5, taylorseer=TaylorSeer(order=2, variable="timestep")
    )
    with pytest.raises(CLIError, match="max_skip_steps"):
        cache_from_spec(f"from:{path},max_skip_steps=2", 28)  # not a cache flag field
    with pytest.raises(CLIError, match="chosen on runs of num_steps=28"):
        cache_from_spec(f"from:{path}", 20)
    with pytest.raises(CLIError, match="no such file"):
        cache_from_spec(f"from:{tmp_path / 'missing.json'}", 28)
    with pytest.raises(CLIError, match="needs a path"):
        cache_from_spec("from:", 28)


def test_calibrate_scales_then_generate_with_them(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "scales.json"
    assert main(["calibrate", "--scales", str(path), *SMALL, "--json"]) == 0
    captured = capsys.readouterr()
    payload = _last_json(captured.out)
    assert payload["path"] == str(path) and "| heldout |" in captured.err and "| calibration |" in captured.err
    from fastdit.quantize import load_scales

    scales = load_scales(path)
    assert scales.layers and all(name.startswith("transformer.") for name in scales.layers)
    provenance = json.loads(path.read_text())["provenance"]
    for part in ("calibration", "heldout"):  # static FP8 of the reference model, on both parts of the split
        assert provenance[part]["psnr_min"] >= 35 and provenance[part]["ssim_min"] >= 0.99, provenance[part]
    assert provenance["heldout_seeds"] == [101] and provenance["headroom"] == 1.0
    assert provenance["weight_scales"] == "tensor"

    spec = f"fp8_static,scales={path}"
    assert main(["generate", "--steps", "12", "--quantize", spec, "--json", "--out", str(tmp_path / "x.png")]) == 0
    out = _last_json(capsys.readouterr().out)
    assert out["quantized"]["transformer"]["mode"] == "fp8_static"
    # Every recorded layer but the 128x128 ones, which the per-tensor modes skip (reported).
    assert 0 < out["quantized"]["transformer"]["num_quantized"] < len(scales.layers)
    assert out["acceleration"]["quantize"]["scales"] == {
        "type": "ActivationScales", "model": scales.model, "num_layers": len(scales.layers)
    }  # fmt: skip


def test_calibrate_scales_checks_row_weight_scales(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "scales.json"
    args = ["calibrate", "--scales", str(path), "--dtype", "bfloat16", "--weight-scales", "row", *SMALL, "--json"]
    assert main(args) == 0
    provenance = json.loads(path.read_text())["provenance"]
    assert provenance["weight_scales"] == "row"
    for part in ("calibration", "heldout"):  # row-wise static FP8 of the reference model in bfloat16
        assert provenance[part]["psnr_min"] >= 30 and provenance[part]["ssim_min"] >= 0.95, provenance[part]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--scales", "x.json", "--out", "y.json"], "argument --out y.json: with --scales the file is --scales x.json"),
        (["--scales", "x.json", "--headroom", "0.5"], "argument --headroom 0.5: Quantize.headroom=0.5"),
        (["--scales", "x.json", "--target-psnr", "30"], "not allowed with argument"),
        (["--scales", "x.json", "--weight-scales", "row"], "argument --weight-scales row: row-wise FP8 weights need"),
        (["--scales", "x.json", "--weight-scales", "column"], "invalid choice: 'column'"),
    ],
)
def test_calibrate_scales_refusals(tmp_path: Path, capsys: Any, monkeypatch: Any, args: list[str], needle: str) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", *args, *SMALL]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
