"""Load test of ``fastdit serve``: N requests at concurrency C, a share of them bad, against a running server.

Good requests ask for one image of the reference pipeline (a digit prompt, a few steps, the server's cache); bad ones
cycle through refusals the server must answer with one exact 4xx status without touching the pipeline (a size off
the model's unit, too many images, no prompt, an unknown cache preset, a negative seed, too many steps, another
model, a body that is not JSON, an edit or a video for a model that makes neither). Every request is checked: a
good one must come back 200 with one image and its own seed, a bad one with its expected status, and every request
must be answered exactly once. Reports throughput, p50/p99 latency (good requests, and bad ones apart) and status
counts; exits 1 on any 5xx, a good request not answered 200, a bad one answered otherwise than expected, or a lost
request. ::

    fastdit serve --queue-size 64 --port 8000 &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --requests 1000 --concurrency 32

``--start`` launches the server itself (the reference pipeline on this machine) on a free port and stops it after;
``--compare-batching B`` runs twice, the second time with ``--max-batch B`` added, and writes both to ``--out-dir``::

    python benchmarks/serve_load.py --start --server-args "--queue-size 64" --requests 1000 --concurrency 32 \
        --compare-batching 4 --out-dir benchmarks/results/2026-12-01_cpu_serve_load
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class Bad:
    """A request the server must refuse: where it goes, what it sends, and the one status it must get."""

    label: str
    path: str
    status: int
    json: dict[str, Any] | None = None
    content: bytes | None = None
    files: dict[str, Any] | None = None


_DIGIT = "a handwritten digit 1"
BAD_REQUESTS: tuple[Bad, ...] = (
    Bad("size off the unit", "/v1/images/generations", 422, {"prompt": _DIGIT, "size": "33x32"}),
    Bad("too many images", "/v1/images/generations", 422, {"prompt": _DIGIT, "n": 99}),
    Bad("no prompt", "/v1/images/generations", 422, {"size": "32x32"}),
    Bad("unknown cache", "/v1/images/generations", 422, {"prompt": _DIGIT, "cache": "bogus"}),
    Bad("negative seed", "/v1/images/generations", 422, {"prompt": _DIGIT, "seed": -1}),
    Bad("too many steps", "/v1/images/generations", 422, {"prompt": _DIGIT, "num_inference_steps": 10_000}),
    Bad("another model", "/v1/images/generations", 404, {"prompt": _DIGIT, "model": "dall-e-3"}),
    Bad("not JSON", "/v1/images/generations", 422, content=b"{prompt: nope"),
    Bad("edit of a text-to-image model", "/v1/images/edits", 400, files={"image": ("a.png", b"x", "image/png")}),
    Bad("video of an image model", "/v1/videos", 400, {"prompt": _DIGIT}),
)
"""Requests every server of the reference pipeline must refuse, each with its status (4xx naming the field)."""


@dataclass
class Outcome:
    """One request: its index, whether it was meant to be good, its status and latency, and whether it got what
    it should (good: 200, one image, its own seed; bad: the expected status)."""

    index: int
    good: bool
    status: int
    seconds: float
    body: dict[str, Any] = field(default_factory=dict)
    as_expected: bool = False
    label: str = "good"


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _request(index: int, args: argparse.Namespace) -> tuple[Bad | None, dict[str, Any]]:
    # Every k-th request is bad, spread evenly so that bad ones meet a busy queue too.
    every = round(1 / args.bad_fraction) if args.bad_fraction > 0 else 0
    if every and index % every == every - 1:
        return BAD_REQUESTS[(index // every) % len(BAD_REQUESTS)], {}
    body = {"prompt": f"a handwritten digit {index % 10}", "seed": index, "num_inference_steps": args.steps}
    return None, body


async def _send(client: httpx.AsyncClient, bad: Bad | None, body: dict[str, Any]) -> httpx.Response:
    if bad is None:
        return await client.post("/v1/images/generations", json=body)
    if bad.files is not None:
        return await client.post(bad.path, data={"prompt": _DIGIT}, files=bad.files)
    if bad.content is not None:
        return await client.post(bad.path, content=bad.content, headers={"Content-Type": "application/json"})
    return await client.post(bad.path, json=bad.json)


def _expected(bad: Bad | None, body: dict[str, Any], status: int, payload: dict[str, Any]) -> bool:
    if bad is not None:
        return status == bad.status and "error" in payload and "Traceback" not in str(payload)
    seeds = payload.get("fastdit", {}).get("seeds")
    return status == 200 and len(payload.get("data", [])) == 1 and seeds == [body["seed"]]


async def _one(client: httpx.AsyncClient, index: int, args: argparse.Namespace) -> Outcome:
    bad, body = _request(index, args)
    start = time.perf_counter()
    try:
        response = await _send(client, bad, body)
        status = response.status_code
        payload = response.json()
    except httpx.HTTPError:
        status, payload = 599, {}  # no response at all counts as a server failure
    except ValueError:
        payload = {}  # a body that is not JSON: never as expected
    seconds = time.perf_counter() - start
    ok = _expected(bad, body, status, payload)
    report = payload.get("fastdit", {}) if bad is None else {}
    return Outcome(index, bad is None, status, seconds, report, ok, "good" if bad is None else bad.label)


async def load(args: argparse.Namespace) -> tuple[list[Outcome], float]:
    """Send ``args.requests`` requests, at most ``args.concurrency`` at a time; return them and the wall time."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency)
    indices = iter(range(args.requests))
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:

        async def worker() -> None:
            for index in indices:  # one shared iterator: each index is sent once
                outcomes.append(await _one(client, index, args))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return outcomes, time.perf_counter() - start


def summarise(outcomes: list[Outcome], wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    """Throughput, latencies, status counts and cache figures of a load run."""
    good = [o for o in outcomes if o.good]
    bad = [o for o in outcomes if not o.good]
    ok = [o for o in good if o.status == 200 and o.as_expected]
    good_latency = [o.seconds for o in ok]
    bad_latency = [o.seconds for o in bad]
    cached = sum(o.body.get("cache", {}).get("cached_steps", 0) for o in ok)
    steps = sum(o.body.get("cache", {}).get("steps", 0) for o in ok)
    return {
        "requests": len(outcomes),
        "concurrency": args.concurrency,
        "steps": args.steps,
        "wall_s": wall_s,
        "throughput_rps": len(outcomes) / wall_s,
        "images_per_s": len(ok) / wall_s,
        "statuses": dict(sorted(Counter(str(o.status) for o in outcomes).items())),
        "good": {
            "sent": len(good),
            "ok": len(ok),
            "p50_s": _percentile(good_latency, 50),
            "p99_s": _percentile(good_latency, 99),
            "mean_s": statistics.fmean(good_latency) if ok else None,
        },
        "bad": {
            "sent": len(bad),
            "4xx": sum(400 <= o.status < 500 for o in bad),
            "as_expected": sum(o.as_expected for o in bad),
            "unexpected": sorted({f"{o.label}: {o.status}" for o in bad if not o.as_expected}),
            "p50_s": _percentile(bad_latency, 50),
            "p99_s": _percentile(bad_latency, 99),
        },
        "answered_once": sorted(o.index for o in outcomes) == list(range(args.requests)),
        "batched_with_max": max((o.body.get("batched_with", 1) for o in ok), default=None),
        "server_errors": sum(o.status >= 500 for o in outcomes),
        "pipeline_s_mean": statistics.fmean(o.body["timings"]["run_s"] for o in ok) if ok else None,
        "queue_s_mean": statistics.fmean(o.body["timings"]["queue_s"] for o in ok) if ok else None,
        "cache_hit_ratio": cached / steps if steps else 0.0,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(args: argparse.Namespace) -> subprocess.Popen:
    port = _free_port()
    args.url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "fastdit", "serve", "--port", str(port), "--log-level", "warning"]
    command += args.server_args.split() if args.server_args else []
    server = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{args.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the server did not start")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--start", action="store_true", help="launch `fastdit serve` on a free port, stop it after")
    parser.add_argument("--server-args", default="--queue-size 64", help="flags for the server --start launches")
    parser.add_argument("--requests", type=int, default=1000, help="requests to send (default 1000)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default 32)")
    parser.add_argument("--bad-fraction", type=float, default=0.25, help="share of bad requests (default 0.25)")
    parser.add_argument("--steps", type=int, default=8, help="num_inference_steps of good requests (default 8)")
    parser.add_argument("--timeout", type=float, default=600.0, help="client timeout per request in seconds")
    parser.add_argument(
        "--api-key", default=os.environ.get("FASTDIT_API_KEY"), help="bearer key, if the server has one"
    )
    parser.add_argument(
        "--compare-batching", type=int, metavar="B", help="with --start: run again with --max-batch B added"
    )
    parser.add_argument("--out", type=Path, help="write the summary as JSON")
    parser.add_argument("--out-dir", type=Path, help="with --compare-batching: write one JSON per run here")
    return parser.parse_args(argv)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    """One load run (starting and stopping the server with ``--start``); its summary."""
    server = _start_server(args) if args.start else None
    try:
        outcomes, wall_s = asyncio.run(load(args))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    summary = summarise(outcomes, wall_s, args)
    summary.update(
        date=date.today().isoformat(),
        machine=f"{platform.machine()} {os.cpu_count()} cores",
        server=args.url if not args.start else "fastdit serve (reference pipeline, --start)",
        server_args=args.server_args if args.start else None,
    )
    return summary


def _failed(summary: dict[str, Any]) -> bool:
    good, bad = summary["good"], summary["bad"]
    return bool(
        summary["server_errors"]
        or good["ok"] != good["sent"]
        or bad["as_expected"] != bad["sent"]
        or not summary["answered_once"]
    )


def _write(path: Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.part")
    temporary.write_text(json.dumps(summary, indent=2) + "\n")
    temporary.replace(path)  # atomic: a reader never sees half a report


def main(argv: list[str] | None = None) -> int:
    """Run the load test; 1 when any response was 5xx, unexpected, or missing."""
    args = _parse(argv)
    runs = {"no_batching": args.server_args}
    if args.compare_batching:
        if not args.start:
            raise SystemExit("--compare-batching needs --start (it restarts the server with --max-batch)")
        runs["batching"] = f"{args.server_args} --max-batch {args.compare_batching}"
    failed = False
    for name, server_args in runs.items():
        args.server_args = server_args
        summary = _run(args)
        print(json.dumps({"run": name, **summary}, indent=2))
        if args.out is not None and len(runs) == 1:
            _write(args.out, summary)
        if args.out_dir is not None:
            _write(args.out_dir / f"{name}.json", summary)
        failed = failed or _failed(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
