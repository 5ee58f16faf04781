"""Load test of ``fastdit serve``: N requests at concurrency C, a share of them bad, against a running server.

Good requests ask for one image of the reference pipeline (a digit prompt, a few steps, the server's cache); bad ones
cycle through refusals the server must answer 4xx without touching the pipeline (a size off the model's unit, too
many images, a missing prompt, an unknown cache preset). Reports throughput, p50/p99 latency (good requests, and
bad ones apart) and status counts; exits 1 when any response was 5xx or a good request failed. ::

    fastdit serve --cache --port 8000 &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --requests 200 --concurrency 16 \
        --out benchmarks/results/2026-12-01_cpu_serve_load.json

``--start`` launches the server itself (the reference pipeline on this machine) on a free port and stops it after.
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

BAD_BODIES: tuple[dict[str, Any], ...] = (
    {"prompt": "a handwritten digit 1", "size": "33x32"},
    {"prompt": "a handwritten digit 1", "n": 99},
    {"size": "32x32"},
    {"prompt": "a handwritten digit 1", "cache": "bogus"},
)
"""Requests every server must refuse with 4xx (422 naming the field)."""


@dataclass
class Outcome:
    """One request: whether it was meant to be good, its status and latency."""

    good: bool
    status: int
    seconds: float
    body: dict[str, Any] = field(default_factory=dict)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _body(index: int, args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    # Every k-th request is bad, spread evenly so that bad ones meet a busy queue too.
    every = round(1 / args.bad_fraction) if args.bad_fraction > 0 else 0
    if every and index % every == every - 1:
        return False, dict(BAD_BODIES[(index // every) % len(BAD_BODIES)])
    body = {"prompt": f"a handwritten digit {index % 10}", "seed": index, "num_inference_steps": args.steps}
    return True, body


async def _one(client: httpx.AsyncClient, index: int, args: argparse.Namespace) -> Outcome:
    good, body = _body(index, args)
    start = time.perf_counter()
    try:
        response = await client.post("/v1/images/generations", json=body)
        status = response.status_code
        payload = response.json() if good and status == 200 else {}
    except httpx.HTTPError:
        status, payload = 599, {}  # no response at all counts as a server failure
    report = payload.get("fastdit", {})
    return Outcome(good, status, time.perf_counter() - start, report)


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
    ok = [o for o in good if o.status == 200]
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
            "p50_s": _percentile(bad_latency, 50),
            "p99_s": _percentile(bad_latency, 99),
        },
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
    parser.add_argument("--server-args", default="--cache", help="flags for the server --start launches")
    parser.add_argument("--requests", type=int, default=200, help="requests to send (default 200)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    parser.add_argument("--bad-fraction", type=float, default=0.25, help="share of bad requests (default 0.25)")
    parser.add_argument("--steps", type=int, default=8, help="num_inference_steps of good requests (default 8)")
    parser.add_argument("--timeout", type=float, default=600.0, help="client timeout per request in seconds")
    parser.add_argument(
        "--api-key", default=os.environ.get("FASTDIT_API_KEY"), help="bearer key, if the server has one"
    )
    parser.add_argument("--out", type=Path, help="write the summary as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the load test; 1 when any response was 5xx or a good request was not answered 200."""
    args = _parse(argv)
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
        server=args.url,
        server_args=args.server_args if args.start else None,
    )
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    failed = summary["server_errors"] or summary["good"]["ok"] != summary["good"]["sent"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
