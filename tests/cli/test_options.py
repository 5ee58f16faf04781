"""Shared flags: ``--parallel`` key=value pairs, cache specs, and config errors blamed on the flags that set them."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from fastdit.cli import CLIError, build_parser, main
from fastdit.cli.options import (
    cache_from_spec,
    check_cache_fits,
    field_error_message,
    parse_attention,
    parse_parallel,
    parse_quantize,
    parse_value,
)
from fastdit.config import Compile, DBCache, DBPrune, Parallel, Quantize, StepMask, TaylorSeer, TeaCache
from fastdit.errors import FieldError, FieldsError
from fastdit.testing.pipelines import build_tiny


@pytest.mark.parametrize(
    ("text", "processes", "expected"),
    [
        ("ulysses=2", 2, Parallel(ulysses=2)),
        ("ulysses=2,ring=2", 4, Parallel(ulysses=2, ring=2)),
        ("ring=3", 3, Parallel(ring=3)),
        ("ulysses=2,comm_fp8", 2, Parallel(ulysses=2, comm_fp8=True)),
        ("ulysses=2, ulysses-chunks=3", 2, Parallel(ulysses=2, ulysses_chunks=3)),
        ("ulysses=2,comm_fp8=false", 2, Parallel(ulysses=2)),
    ],
)
def test_parse_parallel(text: str, processes: int, expected: Parallel) -> None:
    assert parse_parallel(text, processes) == expected


@pytest.mark.parametrize(
    ("text", "processes", "needle"),
    [
        ("ulysses=3", 2, "needs 3 processes"),
        ("heads=2", 2, "'heads=2'"),
        ("ulysses", 2, "'ulysses'"),
        ("ulysses=two", 2, "'ulysses=two'"),
        ("ulysses=2,ulysses_chunks=0", 2, "ulysses_chunks"),
        ("ulysses=2,ulysses-chunks=0", 2, "argument --parallel ulysses-chunks=0: Parallel.ulysses_chunks=0"),
        ("ulysses=2,ulysses=1", 2, "'ulysses=1' in 'ulysses=2,ulysses=1': ulysses is given twice"),
        ("ulysses=2,ulysses_chunks=2,ulysses-chunks=2", 2, "ulysses_chunks is given twice"),
        ("ulysses=2,vae,vae=false", 2, "vae is given twice"),
    ],
)
def test_parse_parallel_rejects(text: str, processes: int, needle: str) -> None:
    with pytest.raises(CLIError, match="--parallel") as info:
        parse_parallel(text, processes)
    assert needle in str(info.value)


def test_cache_spec_refuses_a_repeated_field() -> None:
    with pytest.raises(CLIError, match=r"'fn=2' in 'fn=1,fn=2': fn is given twice"):
        cache_from_spec("fn=1,fn=2", 10)


def test_optional_bool_off_is_false_not_automatic() -> None:
    assert parse_value(bool | None, "off") is False
    assert parse_value(bool | None, "auto") is None
    assert parse_value(int | None, "off") is None  # for a cap, off means no cap


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", *argv])


def _expected_flag(cls: type, name: str) -> str:
    """The flag naming convention of the cache flags (written out here, so that a field without a flag fails)."""
    if cls is TaylorSeer:
        return "--taylorseer" if name == "order" else f"--taylorseer-{name.replace('_', '-')}"
    if cls is StepMask:
        return "--step-mask" if name == "compute_steps" else f"--step-mask-{name.replace('_', '-')}"
    return {"taylorseer": "--taylorseer", "step_mask": "--step-mask"}.get(name, f"--cache-{name.replace('_', '-')}")


CACHE_FIELDS = [(cls, f.name) for cls in (DBCache, DBPrune, TaylorSeer, StepMask) for f in dataclasses.fields(cls)]


@pytest.mark.parametrize(("cls", "name"), CACHE_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in CACHE_FIELDS])
def test_every_cache_field_error_names_its_flag(cls: type, name: str) -> None:
    flag = _expected_flag(cls, name)
    error = FieldError(cls.__name__, name, "v", "must be good")
    assert field_error_message(error, _args(flag, "v")) == f"argument {flag} v: {error}"
    # Not passed: the preset that chose the value is blamed.
    assert field_error_message(error, _args("--cache", "fast")) == f"argument --cache fast: {error}"


def test_cache_flags_set_the_teacache_fields_of_their_name() -> None:
    from fastdit.cli.options import cache_from_args

    config = cache_from_args(_args("--cache", "video", "--cache-decide-ahead", "true"), 28)
    assert isinstance(config, TeaCache) and config.decide_ahead and config.signal == "spectral"
    error = FieldError("TeaCache", "decide_ahead", "v", "must be a bool")
    flag = "--cache-decide-ahead"
    assert field_error_message(error, _args(flag, "v")) == f"argument {flag} v: {error}"
    with pytest.raises(CLIError, match=r"argument --cache-threshold -1: TeaCache\.threshold"):
        cache_from_args(_args("--cache", "video", "--cache-threshold", "-1"), 28)


@pytest.mark.parametrize(
    ("error", "argv", "prefix"),
    [
        (
            FieldsError("DBCache", {"fn": 5, "bn": 5}, "leaves no middle block"),
            ["--cache-fn", "5", "--cache-bn", "5", "--cache-threshold", "0.2"],
            "arguments --cache-fn 5, --cache-bn 5: ",
        ),
        (FieldsError("DBCache", {"fn": 7, "bn": 1}, "no middle"), ["--cache-fn", "7"], "argument --cache-fn 7: "),
        (FieldsError("DBCache", {"fn": 8, "bn": 0}, "no middle"), ["--cache", "dbcache"], "argument --cache dbcache: "),
        (FieldError("Compile", "cuda_graph", True, "needs CUDA"), ["--cuda-graph"], "argument --cuda-graph: "),
        (
            FieldsError("Compile", {"mode": "max-autotune", "cuda_graph": True}, "both graph"),
            ["--compile", "--cuda-graph"],
            "argument --cuda-graph: ",
        ),
        (FieldError("Compile", "max_graphs", 0, "must be >= 1"), ["--compile"], "argument --compile: "),
        (
            FieldError("Parallel", "ulysses", 0, "must be >= 1"),
            ["--parallel", "ulysses=0"],
            "argument --parallel ulysses=0: ",
        ),
        (FieldError("Attention", "backend", "x", "unknown"), ["--attention", "x"], "argument --attention x: "),
        (FieldError("DBCache", "fn", 0, "must be >= 1"), [], ""),  # nothing passed set it: the error alone
    ],
)
def test_field_errors_name_the_flags_passed(error: FieldError, argv: list[str], prefix: str) -> None:
    assert field_error_message(error, _args(*argv)) == f"{prefix}{error}"


def test_check_cache_fits_names_fn_and_bn() -> None:
    pipe, _ = build_tiny("flux")  # 3 transformer blocks
    check_cache_fits(pipe, DBCache(fn=1, bn=1))
    check_cache_fits(pipe, DBPrune(fn=2, bn=1))  # DBPrune is not checked: it has no such rule
    check_cache_fits(pipe, None)
    with pytest.raises(FieldsError, match=r"^DBCache\(fn=2, bn=1\): leaves no middle block .*3 blocks") as info:
        check_cache_fits(pipe, DBCache(fn=2, bn=1))
    assert (info.value.owner, info.value.fields) == ("DBCache", {"fn": 2, "bn": 1})


TINY = ["--prompt", "a", "--height", "32", "--width", "32", "--steps", "2", "--quiet"]


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--cache-fn", "2", "--cache-bn", "1"],
            "fastdit: error: arguments --cache-fn 2, --cache-bn 1: DBCache(fn=2, bn=1): leaves no middle block",
        ),
        (["--cache", "dbcache"], "fastdit: error: argument --cache dbcache: DBCache(fn=8, bn=0): leaves no middle"),
        (["--cuda-graph"], "fastdit: error: argument --cuda-graph: CudaGraph.device='cpu': the transformer must be"),
    ],
)
def test_generate_blames_the_flags_passed_after_loading(
    argv: list[str], line: str, tiny_flux_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "out" / "x.png"
    assert main(["generate", "--model-path", str(tiny_flux_dir), *TINY, *argv, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    errors = [text for text in captured.err.splitlines() if text.startswith("fastdit: error:")]
    assert len(errors) == 1 and errors[0].startswith(line), captured.err
    assert captured.out == "" and not out.parent.exists()


def test_offload_spec_reads_the_config_fields() -> None:
    from fastdit.cli.options import parse_config_fields
    from fastdit.config import Offload

    assert parse_config_fields(Offload, "", "--offload") == Offload()
    spec = "resident_blocks=4, prefetch=1,pin_memory=false"
    assert parse_config_fields(Offload, spec, "--offload") == Offload(resident_blocks=4, prefetch=1, pin_memory=False)
    with pytest.raises(CLIError, match=r"argument --offload: 'blocks=2' in 'blocks=2' is not field=value"):
        parse_config_fields(Offload, "blocks=2", "--offload")
    with pytest.raises(CLIError, match=r"argument --offload prefetch=-1: Offload.prefetch=-1: must be an integer"):
        parse_config_fields(Offload, "prefetch=-1", "--offload")
    with pytest.raises(CLIError, match=r"prefetch is given twice"):
        parse_config_fields(Offload, "prefetch=1,prefetch=2", "--offload")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fp8", Quantize(mode="fp8")),
        ("int8_weight,min_size=4096", Quantize(mode="int8_weight", min_size=4096)),
        (
            "mode=fp8_tensor,exclude=*.norm1.linear,*.ff.*",
            Quantize(mode="fp8_tensor", exclude=("*.norm1.linear", "*.ff.*")),
        ),
        ("int8,include=*,exclude=proj_out", Quantize(mode="int8", include=("*",), exclude=("proj_out",))),
        ("min-size=8", Quantize(min_size=8)),
    ],
)
def test_parse_quantize(text: str, expected: Quantize) -> None:
    assert parse_quantize(text) == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("fp4", "argument --quantize mode=fp4: Quantize.mode='fp4': must be one of 'fp8'"),
        ("fp8,bits=4", "'bits=4' in 'fp8,bits=4' is not MODE"),
        ("fp8,mode=int8", "mode is given twice"),
        ("int8,min_size=-1", "argument --quantize min_size=-1: Quantize.min_size=-1"),
        ("int8,min_size=big", "'min_size=big' in 'int8,min_size=big': expected an integer"),
        ("", "empty specification"),
        ("fp8_static", "needs the activation scales of a calibration"),
        ("fp8_static,scales=/nonexistent/s.json", "cannot read /nonexistent/s.json: No such file"),
        ("fp8_static,calibrate=true", "fastdit calibrate MODEL --scales PATH"),
        ("fp8,headroom=2", "scales, headroom, calibrate and weight_scales belong to mode='fp8_static'"),
    ],
)
def test_parse_quantize_rejects(text: str, needle: str) -> None:
    with pytest.raises(CLIError, match="--quantize") as info:
        parse_quantize(text)
    assert needle in str(info.value)


def test_parse_quantize_reads_a_scales_file(tmp_path: Path) -> None:
    from fastdit.config import ActivationScales
    from fastdit.quantize import save_scales

    scales = ActivationScales(layers=("transformer.a", "transformer.b"), amax=(1.5, 2.0), ndims=(3, 2), model="M")
    save_scales(tmp_path / "s.json", scales)
    expected = Quantize(mode="fp8_static", scales=scales, headroom=2.0)
    assert parse_quantize(f"fp8_static,scales={tmp_path / 's.json'},headroom=2") == expected
    rows = Quantize(mode="fp8_static", scales=scales, weight_scales="row")
    assert parse_quantize(f"fp8_static,scales={tmp_path / 's.json'},weight_scales=row") == rows
    with pytest.raises(CLIError, match=r"Quantize\.weight_scales='column'"):
        parse_quantize(f"fp8_static,scales={tmp_path / 's.json'},weight_scales=column")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(CLIError, match="format None, expected 'fastdit-scales/1'"):
        parse_quantize(f"fp8_static,scales={tmp_path / 'bad.json'}")


def test_parse_attention_reads_a_backend_and_a_scales_file(tmp_path: Path) -> None:
    from fastdit.config import ActivationScales, Attention
    from fastdit.quantize import save_scales

    assert parse_attention("math") == Attention(backend="math")
    assert parse_attention("cudnn,gqa=repeat") == Attention(backend="cudnn", gqa="repeat")
    names = ("transformer.attn:q", "transformer.attn:k", "transformer.attn:v")
    scales = ActivationScales(layers=names, amax=(1.0, 2.0, 3.0), ndims=(4, 4, 4), model="M")
    save_scales(tmp_path / "s.json", scales)
    expected = Attention(backend="cudnn-fp8", scales=scales, headroom=1.5)
    assert parse_attention(f"cudnn-fp8,scales={tmp_path / 's.json'},headroom=1.5") == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("warp", "argument --attention backend=warp: Attention.backend='warp': must be one of 'sdpa'"),
        ("math,scales=/nonexistent/s.json", "cannot read /nonexistent/s.json: No such file"),
        ("cudnn-fp8,calibrate=true", "fastdit calibrate MODEL --scales PATH"),
        ("math,headroom=2", "scales and headroom belong to backend='cudnn-fp8'"),
        ("math,tiles=2", "'tiles=2' in 'math,tiles=2' is not BACKEND"),
        ("", "empty specification"),
    ],
)
def test_parse_attention_rejects(text: str, needle: str) -> None:
    with pytest.raises(CLIError, match="--attention") as info:
        parse_attention(text)
    assert needle in str(info.value)


def test_compile_vae_flag_compiles_blocks_and_decoder() -> None:
    """``--compile-vae`` alone asks for compiled blocks and decoders; ``--compile`` alone leaves the VAE eager."""
    from fastdit.cli.generate import acceleration_options

    assert acceleration_options(_args("--compile-vae"), 4)["compile"] == Compile(vae=True)
    assert acceleration_options(_args("--compile"), 4)["compile"] == Compile()
    assert acceleration_options(_args("--compile-outer"), 4)["compile"] == Compile(outer=True)
    error = FieldError("Compile", "vae", "x", "must be a bool")
    assert field_error_message(error, _args("--compile-vae")).startswith("argument --compile-vae: ")
