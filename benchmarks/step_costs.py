"""What one denoising step costs on the GPU's timeline: computed steps vs cached ones, against one block.

The FLUX.1-dev-sized pipeline of ``cp_flux.py`` (random bf16 weights, 1024², 28 steps, no text encoder) runs each
mode twice (the first call warms up and compiles); during the second call a CUDA event is recorded on the stream at
the start of every transformer call and once after the last, so the time between two events is what one step adds
to the stream's timeline — including the stretches the GPU waits for the host (a host decision, Python between
kernels), which a kernel profile does not show. Steps are split into computed and cached by the cache's own summary.
The front block is timed the same way (events before and after its call in cached steps), and one block replayed
alone gives the reference the cached-step goal is stated in ("a cached step costs at most its Fn + Bn blocks + 10 %").

    python benchmarks/step_costs.py --out benchmarks/results/<date>_h200_single/step_costs.json
    python benchmarks/step_costs.py --tiny          # CPU smoke test (host clock instead of CUDA events)

Modes are ``cp_flux.py`` modes (``single+compile+graph+cache4`` ...); the first is usually the uncached one.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import itertools
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cp_flux
import torch

import fastdit
from fastdit.bench import device_name, json_ready, markdown_table
from fastdit.io import write_json
from fastdit.process import choose_device

# The FLUX transformer's modules outside its blocks, each called once per transformer call.
OUTER_MODULES = ("x_embedder", "time_text_embed", "context_embedder", "pos_embed", "norm_out", "proj_out")
DEFAULT_MODES = (
    "single+compile+graph",
    "single+compile+graph+cache",
    "single+compile+graph+cache4",
    "single+compile+graph+magfast",
)


class StreamClock:
    """Marks on the device's timeline (CUDA events; the host clock on a CPU) and the elapsed time between them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (synchronises once)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in itertools.pairwise(self.marks)]
        return [1e3 * (b - a) for a, b in itertools.pairwise(self.marks)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, 64x64 (CPU smoke test)")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--size", type=int, default=None, help="height and width (default 1024; 64 with --tiny)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated cp_flux.py modes")
    parser.add_argument("--block-repeats", type=int, default=50, help="replays of one block for its reference time")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/step_costs.json if OUT is set)")
    parser.add_argument(
        "--host-profile",
        type=Path,
        default=None,
        help="folder for a profile of one more call per mode: cProfile (host) and a torch.profiler trace",
    )
    return parser.parse_args()


def measure_mode(
    pipe: Any, mode: str, kwargs: dict[str, Any], device: torch.device, steps: int, host_profile: Path | None = None
) -> dict[str, Any]:
    """One mode: per-step timeline costs of its second call, split by whether the step computed.

    Beside the device's timeline, the host's: how long the host spends inside each transformer call and from one
    call's start to the next. A cached step whose host time exceeds its device time leaves the GPU waiting (a run of
    consecutive cached steps shows it: each costs its host time, not its kernels')."""
    undo = cp_flux.accelerate_mode(pipe, mode, 1, steps)
    try:
        call = lambda: pipe(**kwargs, generator=torch.Generator(device).manual_seed(0), output_type="latent")  # noqa: E731
        start = time.perf_counter()
        call()
        first_s = time.perf_counter() - start
        steps_clock, front_clock, end_clock = StreamClock(device), StreamClock(device), StreamClock(device)
        host_starts: list[float] = []
        host_ends: list[float] = []
        outer_clocks = {name: StreamClock(device) for name in OUTER_MODULES}
        handles = [
            pipe.transformer.register_forward_pre_hook(lambda *_: both(steps_clock.mark, host_starts)),
            pipe.transformer.register_forward_hook(lambda *_: both(end_clock.mark, host_ends)),
            *marks_around(pipe.transformer.transformer_blocks[0], front_clock),
        ]
        for name, clock in outer_clocks.items():
            handles += marks_around(getattr(pipe.transformer, name), clock)
        try:
            start = time.perf_counter()
            call()
            steps_clock.mark()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall_s = time.perf_counter() - start
        finally:
            for handle in handles:
                handle.remove()
        cached = cached_steps(pipe)
        if host_profile is not None:  # a third call: the profilers' own overhead stays out of the timed one
            profile_call(pipe, call, host_profile / mode.replace("+", "_"))
    finally:
        undo()
    step_ms = steps_clock.intervals_ms()
    host_call_ms = [1e3 * (e - s) for s, e in zip(host_starts, host_ends, strict=True)]
    host_step_ms = [1e3 * (b - a) for a, b in itertools.pairwise(host_starts)]
    front_ms = front_clock.intervals_ms()[::2]  # pre -> post of each call
    starts, ends = steps_clock.marks[:-1], end_clock.marks
    # From a call's end to the next call's start: the scheduler and the pipeline's loop (on the stream's timeline).
    between = [e.elapsed_time(s) if end_clock.cuda else 1e3 * (s - e) for e, s in zip(ends, starts[1:], strict=False)]
    outer_ms = {name: clock.intervals_ms()[::2] for name, clock in outer_clocks.items()}
    return {
        "mode": mode,
        "first_call_s": round(first_s, 3),
        "wall_s": round(wall_s, 4),
        "cached_steps": sorted(cached),
        "step_ms": [round(x, 3) for x in step_ms],
        "computed_step_ms": median([x for i, x in enumerate(step_ms) if i not in cached]),
        "cached_step_ms": median([x for i, x in enumerate(step_ms) if i in cached]),
        "front_block_ms_cached_steps": median([x for i, x in enumerate(front_ms) if i in cached]),
        "between_calls_ms_after_cached": median([x for i, x in enumerate(between) if i in cached]),
        "host_call_ms": [round(x, 3) for x in host_call_ms],
        "host_cached_call_ms": median([x for i, x in enumerate(host_call_ms) if i in cached]),
        "host_step_ms_after_cached": median([x for i, x in enumerate(host_step_ms) if i in cached]),
        "outer_ms_cached_steps": {
            name: median([x for i, x in enumerate(values) if i in cached]) for name, values in outer_ms.items()
        },
    }


def both(mark: Callable[[], None], host_marks: list[float]) -> None:
    """A device mark and a host one (returns ``None``, so a pre-hook leaves the arguments alone)."""
    host_marks.append(time.perf_counter())
    mark()


def profile_call(pipe: Any, call: Callable[[], Any], folder: Path) -> None:
    """One more call under cProfile and ``torch.profiler``, each transformer call marked ``call<i>`` in the trace.

    Writes ``host.txt`` (host functions by own time, top 60, and by cumulative time, top 40) and ``trace.json.gz``
    (host and device timelines, for finding what a cached step launches and where the device waits).
    """
    folder.mkdir(parents=True, exist_ok=True)
    marks: list[Any] = []

    def enter(*_: Any) -> None:
        marks.append(torch.profiler.record_function(f"call{len(marks)}"))
        marks[-1].__enter__()

    handles = [
        pipe.transformer.register_forward_pre_hook(enter),
        pipe.transformer.register_forward_hook(lambda *_: marks[-1].__exit__(None, None, None)),
    ]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    host = cProfile.Profile()
    try:
        with torch.profiler.profile(activities=activities) as prof:
            host.enable()
            call()
            host.disable()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    text = io.StringIO()
    stats = pstats.Stats(host, stream=text).strip_dirs()  # file names only: no install paths in the results
    stats.sort_stats("tottime").print_stats(60)
    stats.sort_stats("cumulative").print_stats(40)
    (folder / "host.txt").write_text(text.getvalue())
    trace = folder / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())
    events.pop("traceName", None)  # the export's own path
    with gzip.open(folder / "trace.json.gz", "wt") as packed:
        json.dump(events, packed)
    trace.unlink()


def marks_around(module: torch.nn.Module, clock: StreamClock) -> list[Any]:
    """Hooks marking ``clock`` before and after each call of ``module``."""
    return [
        module.register_forward_pre_hook(lambda *_: clock.mark()),
        module.register_forward_hook(lambda *_: clock.mark()),
    ]


def cached_steps(pipe: Any) -> set[int]:
    try:
        cache = fastdit.summary(pipe).transformers.get("transformer", {}).get("cache")
    except ValueError:  # nothing applied
        return set()
    if not cache:
        return set()
    return {s for branch in cache["branches"].values() for s in branch["cached_steps"]}


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def one_block_ms(pipe: Any, kwargs: dict[str, Any], device: torch.device, repeats: int) -> dict[str, float]:
    """One double-stream and one single-stream block alone (eager and compiled), at the run's shapes."""
    captured: dict[str, tuple[tuple, dict]] = {}

    def capture(name: str) -> Callable[..., None]:
        def hook(_module: Any, args: tuple, call_kwargs: dict) -> None:
            captured.setdefault(name, (args, call_kwargs))

        return hook

    blocks = {"double": pipe.transformer.transformer_blocks[0], "single": pipe.transformer.single_transformer_blocks[0]}
    handles = [b.register_forward_pre_hook(capture(n), with_kwargs=True) for n, b in blocks.items()]
    try:
        one_step = {**kwargs, "num_inference_steps": 1}
        pipe(**one_step, generator=torch.Generator(device).manual_seed(0), output_type="latent")
    finally:
        for handle in handles:
            handle.remove()
    out = {}
    for name, block in blocks.items():
        args, call_kwargs = captured[name]
        for label, fn in (("eager", block.forward), ("compiled", torch.compile(block.forward))):
            with torch.no_grad():
                for _ in range(3):
                    fn(*args, **call_kwargs)
                clock = StreamClock(device)
                clock.mark()
                for _ in range(repeats):
                    fn(*args, **call_kwargs)
                clock.mark()
            out[f"{name}_{label}_ms"] = round(clock.intervals_ms()[0] / repeats, 3)
    torch._dynamo.reset()
    return out


def main() -> None:
    args = parse_args()
    device = choose_device()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    size = args.size or (64 if args.tiny else 1024)
    pipe = cp_flux.build_pipeline(args.tiny, device, dtype, 0)
    kwargs = {**cp_flux.embeddings(args.tiny, device, dtype, 0), "height": size, "width": size,
              "num_inference_steps": args.steps, "guidance_scale": 3.5}  # fmt: skip
    blocks = one_block_ms(pipe, kwargs, device, args.block_repeats)
    rows = [measure_mode(pipe, mode, kwargs, device, args.steps, args.host_profile) for mode in args.modes.split(",")]
    print(f"\nFLUX.1-dev-sized ({'tiny' if args.tiny else 'full'}), {size}x{size}, {args.steps} steps, "
          f"{device_name(device)}; one block alone: {blocks}\n")  # fmt: skip
    header = ("mode", "wall s", "cached steps", "computed step ms", "cached step ms", "front block ms (cached steps)",
              "outer modules ms (cached steps)", "between calls ms", "host ms per cached call",
              "host ms per step after a cached one")  # fmt: skip
    cells = [
        (
            r["mode"],
            r["wall_s"],
            len(r["cached_steps"]),
            r["computed_step_ms"],
            r["cached_step_ms"],
            r["front_block_ms_cached_steps"],
            sum(v for v in r["outer_ms_cached_steps"].values() if v is not None) if r["cached_steps"] else None,
            r["between_calls_ms_after_cached"],
            r["host_cached_call_ms"],
            r["host_step_ms_after_cached"],
        )
        for r in rows
    ]
    print(markdown_table(header, cells), end="")
    out = args.out or (Path(os.environ["OUT"]) / "step_costs.json" if "OUT" in os.environ else None)
    if out is not None:
        payload = {"benchmark": "step_costs", "date": date.today().isoformat(), "device": device_name(device),
                   "torch": torch.__version__, "config": {"tiny": args.tiny, "steps": args.steps, "size": size},
                   "one_block": blocks, "results": rows}  # fmt: skip
        write_json(out, json_ready(payload))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
