"""Host memory and wall time of loading a pipeline under each ``--load`` mode, on the CPU with gloo.

Builds a FLUX-layout pipeline folder whose transformer holds ~280 MB of float32 weights (the tiny text encoders and
VAE of the test pipelines around it), then, for each process count and mode, launches ``torchrun`` and records on
every rank: RSS just before loading, peak RSS (``getrusage``), RSS and USS after loading, and the load's wall time
(all ranks start together after a barrier; a rank's time ends when it holds every tensor), then the time until it
has read every byte once (what a first forward pass does: weights loaded by mapping the files are read only then)
and the PSS and USS rises. ``node-rank0`` runs as
two loopback "nodes" (two ``torchrun --nnodes 2`` launches meeting by c10d on 127.0.0.1), each with half the
processes; the other modes run as one launch.

    python benchmarks/load_broadcast.py --out benchmarks/results/2026-12-01_cpu_load_broadcast

Files are read through the page cache (a first untimed load warms it), so "every-rank" is timed at its best: on a
shared filesystem every rank's read is a network read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("every-rank", "rank0", "node-rank0")
# A FLUX transformer of 4 double and 8 single blocks at width 512: ~69 M parameters, ~280 MB in float32.
TRANSFORMER = {
    "num_layers": 4,
    "num_single_layers": 8,
    "attention_head_dim": 64,
    "num_attention_heads": 8,
    "axes_dims_rope": [16, 24, 24],
}


def build_folder(directory: Path) -> Path:
    """Save the tiny FLUX pipeline with a larger transformer into ``directory`` (once)."""
    if (directory / "model_index.json").is_file():
        return directory
    import torch
    from diffusers import FluxTransformer2DModel

    from fastdit.testing.pipelines import build_tiny

    pipe, _ = build_tiny("flux")
    config = {**dict(pipe.transformer.config), **TRANSFORMER}
    torch.manual_seed(0)
    pipe.transformer = FluxTransformer2DModel.from_config(config)
    pipe.register_modules(transformer=pipe.transformer)
    pipe.save_pretrained(directory, safe_serialization=True)
    return directory


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _pss_uss() -> tuple[int, int]:
    import psutil

    info = psutil.Process().memory_full_info()
    return info.pss, info.uss


def _touch(pipe: Any) -> float:
    """Read every byte of every tensor, as a first forward pass does (mapped file pages are read only then)."""
    import torch

    total = 0.0
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            for tensor in [*component.parameters(), *component.buffers()]:
                total += float(tensor.detach().float().sum())
    return total


def worker(folder: Path, mode: str, dtype_name: str, out: Path) -> None:
    """One rank: join the group, wait for the others, load with ``mode``, record memory and time."""
    import torch
    import torch.distributed as dist

    from fastdit.config import Loading
    from fastdit.process import join_process_group
    from fastdit.session import Session, import_pipeline_class, resolve_model

    torch.set_num_threads(1)
    source = resolve_model(None, str(folder))
    import_pipeline_class(source.pipeline_class)  # imports counted before the baseline, not in the load
    join_process_group("cpu", 600.0)
    dist.barrier()
    before = _rss()
    pss_before, uss_before = _pss_uss()
    dtype = getattr(torch, dtype_name)
    start = time.perf_counter()
    session = Session.load(source, device="cpu", dtype=dtype, loading=Loading(mode=mode, timeout_s=600.0))
    seconds = time.perf_counter() - start
    _touch(session.pipe)
    ready = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    pss_after, uss_after = _pss_uss()
    weights = sum(
        t.numel() * t.element_size()
        for c in session.pipe.components.values()
        if isinstance(c, torch.nn.Module)
        for t in [*c.parameters(), *c.buffers()]
    )
    record = {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "reads_files": mode == "every-rank"
        or (mode == "rank0" and dist.get_rank() == 0)
        or (mode == "node-rank0" and os.environ.get("LOCAL_RANK") == "0"),
        "load_seconds": seconds,
        "ready_seconds": ready,
        "rss_before_bytes": before,
        "peak_rss_bytes": peak,
        "peak_rss_increase_bytes": peak - before,
        "rss_after_bytes": _rss(),
        "pss_increase_bytes": pss_after - pss_before,
        "uss_increase_bytes": uss_after - uss_before,
        "weights_bytes": weights,
    }
    dist.barrier()
    (out / f"rank{record['rank']}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nnodes: int, nproc: int, port: int, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"load-{port}"]
    command += [__file__, "--worker", *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def launch(folder: Path, mode: str, nprocs: int, dtype: str) -> dict[str, Any]:
    """Run one configuration and return its per-rank records and a summary."""
    with tempfile.TemporaryDirectory(prefix="load-broadcast-") as scratch:
        args = ["--folder", str(folder), "--mode", mode, "--dtype", dtype, "--records", scratch]
        port = _free_port()
        nodes = 2 if mode == "node-rank0" else 1
        launches = [_torchrun(nodes, nprocs // nodes, port, args) for _ in range(nodes)]
        logs = [p.communicate(timeout=900)[0] for p in launches]
        for process, log in zip(launches, logs, strict=True):
            if process.returncode != 0:
                raise RuntimeError(f"{mode} x{nprocs} failed:\n{log[-4000:]}")
        ranks = sorted((json.loads(p.read_text()) for p in Path(scratch).glob("rank*.json")), key=lambda r: r["rank"])
    return {"mode": mode, "dtype": dtype, "processes": nprocs, "nodes": nodes, "ranks": ranks, **summarize(ranks)}


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Job-level figures: the slowest rank's load time, and memory of the reading and the receiving ranks."""
    readers = [r for r in ranks if r["reads_files"]]
    receivers = [r for r in ranks if not r["reads_files"]]

    def mean(rows: list[dict[str, Any]], key: str) -> float | None:
        return sum(r[key] for r in rows) / len(rows) if rows else None

    return {
        "load_seconds_max": max(r["load_seconds"] for r in ranks),
        "ready_seconds_max": max(r["ready_seconds"] for r in ranks),
        "readers": len(readers),
        "reader_peak_rss_increase_bytes": mean(readers, "peak_rss_increase_bytes"),
        "receiver_peak_rss_increase_bytes": mean(receivers, "peak_rss_increase_bytes"),
        # Proportional set size counts a page mapped by k processes 1/k in each: the sum is the node's RAM.
        "sum_pss_increase_bytes": sum(r["pss_increase_bytes"] for r in ranks),
        "sum_uss_increase_bytes": sum(r["uss_increase_bytes"] for r in ranks),
        "weights_bytes": ranks[0]["weights_bytes"],
    }


def _table(runs: list[dict[str, Any]]) -> str:
    mib = 2**20
    lines = [
        "| dtype | processes | mode | load s | load + first read s | peak RSS rise, reader / receiver | "
        "RAM of all ranks (sum of PSS rises) | private (sum of USS rises) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        receiver = run["receiver_peak_rss_increase_bytes"]
        lines.append(
            f"| {run['dtype']} | {run['processes']} | {run['mode']} | {run['load_seconds_max']:.2f} | "
            f"{run['ready_seconds_max']:.2f} | {run['reader_peak_rss_increase_bytes'] / mib:.0f} / "
            f"{'-' if receiver is None else f'{receiver / mib:.0f}'} MiB | "
            f"{run['sum_pss_increase_bytes'] / mib:.0f} MiB | {run['sum_uss_increase_bytes'] / mib:.0f} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for results.json and table.md")
    parser.add_argument("--folder", type=Path, help="pipeline folder (built there if missing; default: a temp dir)")
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="load dtypes (files: float32)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--records", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.folder, args.mode, args.dtype, args.records)
        return
    folder = build_folder(args.folder or Path(tempfile.mkdtemp(prefix="load-broadcast-model-")) / "flux")
    launch(folder, "every-rank", 2, "float32")  # warms the page cache; not recorded
    runs = []
    for dtype in args.dtypes:
        for nprocs in args.processes:
            for mode in args.modes:
                runs.append(launch(folder, mode, nprocs, dtype))
                print(_table(runs[-1:]).splitlines()[-1], flush=True)
    table = _table(runs)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        import torch

        meta = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()}
        payload = {"date": time.strftime("%Y-%m-%d"), "machine": meta, "transformer": TRANSFORMER, "runs": runs}
        (args.out / "results.json").write_text(json.dumps(payload, indent=2))
        (args.out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
