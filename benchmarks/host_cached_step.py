"""Host (Python) time of a cached DBCache step on the CPU, where kernels cost next to nothing and Python is measured.

The transformer is a FLUX.1-dev-structured ``FluxTransformer2DModel`` (19 double-stream + 38 single-stream blocks)
with a tiny hidden size (2 heads of 16) and 4 image + 4 text tokens, so a block's kernels take microseconds and a
transformer call's time is what the host spends issuing it. DBCache F1B0 runs on a static step mask: of each run's
28 steps, 0, 10 and 20 compute and every other step is cached (the first block computes, the other 56 are skipped),
whatever the residuals are. Timed per transformer call (``time.perf_counter_ns`` around the call, median over every
call of its kind):

* ``fastdit``: this checkout's fastdit (``src`` beside this folder), installed with ``fastdit.accelerate``;
* ``fastdit (before)``: another checkout's fastdit (``--baseline-src``), to compare a change before and after;
* ``diffusers``: the model without any hook (every call computes all 57 blocks);
* ``diffusers 1-block``: the same model with one double-stream block and no single-stream one, no hook: the modules
  outside the blocks plus one block, which a cached F1B0 call cannot undercut without leaving the model's own loop;
* ``diffusers pass-through``: no hook, every block but the first given a ``forward`` that returns its inputs: what
  the model's own loop and module calls cost per block, the floor of any per-block hook (the outputs are not a
  cache's, only the cost);
* ``cache-dit``: cache-dit's DBCache F1B0 on the same static mask (when ``cache_dit`` imports), which replaces the
  model's block loop by its own and so never calls the skipped blocks.

Each variant runs in its own process (their hooks do not all come off cleanly, and two fastdit checkouts cannot share
one interpreter); the processes take turns, one round of runs each, so machine noise falls on all of them alike. The
cost of one skipped block is the slope between the 57-block model and a 4-block one (2 + 2, 3 blocks skipped):
``(cached call, 57 blocks − cached call, 4 blocks) / 53``. A cProfile of cached calls gives the functions and files
the host's time goes to. The fastdit variants' outputs over one run are hashed: a change to the host path must leave
them bit for bit equal (the table says so, and the run fails otherwise).

    python benchmarks/host_cached_step.py --out benchmarks/results/<date>_cpu_host_cached_step/host_cached_step.json
    python benchmarks/host_cached_step.py --baseline-src <other checkout>/src --rounds 40
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import IO, Any

import torch

STEPS = 28
COMPUTE_STEPS = (0, 10, 20)
# (double-stream, single-stream) blocks: FLUX.1-dev's stack, and the small one the per-block slope is taken against.
LARGE = (19, 38)
SMALL = (2, 2)
VARIANTS = ("fastdit", "fastdit (before)", "diffusers", "diffusers 1-block", "diffusers pass-through", "cache-dit")
_REPLY = "@@host_cached_step "  # marks the workers' protocol lines (libraries may print too)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds; each variant runs --runs runs per round")
    parser.add_argument("--runs", type=int, default=2, help="runs of 28 steps per variant and model per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per variant and model first")
    parser.add_argument("--profile-runs", type=int, default=8, help="runs under cProfile (cached calls kept)")
    parser.add_argument("--top", type=int, default=25, help="functions kept per cProfile ordering")
    parser.add_argument("--baseline-src", type=Path, default=None, help="another fastdit checkout's src, as 'before'")
    parser.add_argument("--baseline-label", default=None, help="what --baseline-src is (a commit), for the table")
    parser.add_argument("--label", default=None, help="what this checkout is (a commit), for the table")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/host_cached_step.json)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


# --- the model and its calls (run in the workers) ---


def build_model(num_layers: int, num_single_layers: int) -> torch.nn.Module:
    """A FLUX.1-dev-structured transformer, tiny and seeded (the same weights in every process)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    with torch.no_grad():  # random residual branches, shrunk so 57 of them stay finite (the outputs are hashed)
        for block in model.transformer_blocks:
            for linear in (block.attn.to_out[0], block.attn.to_add_out, block.ff.net[2], block.ff_context.net[2]):
                linear.weight.mul_(0.2)
        for block in model.single_transformer_blocks:
            block.proj_out.weight.mul_(0.2)
    return model


def call_inputs() -> dict[str, Any]:
    """One call's arguments but the timestep: 4 image tokens (2x2 latent), 4 text tokens, FLUX.1-dev's guidance."""
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, 4, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "img_ids": torch.zeros(4, 3),
        "txt_ids": torch.zeros(4, 3),
        "guidance": torch.full((1,), 3.5),
        "return_dict": False,
    }


def timesteps() -> list[torch.Tensor]:
    """A run's timesteps as FluxPipeline passes them (``t / 1000``, falling)."""
    return [torch.full((1,), 1.0 - i / STEPS) for i in range(STEPS)]


class Subject:
    """One variant on one model: ``run()`` makes one run of :data:`STEPS` calls and returns each call's host ns."""

    def __init__(self, variant: str, blocks: tuple[int, int]) -> None:
        self.variant = variant
        self.model = build_model(*blocks)
        self.kwargs = call_inputs()
        self.times = timesteps()
        self.begin: Callable[[], None] = lambda: None  # before each run (outside the timing)
        if variant.startswith("fastdit"):
            self._install_fastdit()
        elif variant == "cache-dit":
            self._install_cache_dit()
        elif variant == "diffusers pass-through":
            for block in [*self.model.transformer_blocks, *self.model.single_transformer_blocks][1:]:
                block.forward = _returns_its_inputs
        # The cached calls of a run (by index): the mask's complement, where a cache is installed.
        cached = variant.startswith("fastdit") or variant == "cache-dit"
        self.cached = [cached and i not in COMPUTE_STEPS for i in range(STEPS)]
        if variant == "diffusers pass-through":  # every call is shaped like a cached one
            self.cached = [True] * STEPS

    def _install_fastdit(self) -> None:
        import fastdit

        mask = fastdit.StepMask(compute_steps=COMPUTE_STEPS, policy="static")
        fastdit.accelerate(self.model, cache=fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask))
        self.begin = lambda: fastdit.reset(self.model)

    def _install_cache_dit(self) -> None:
        import copy

        import cache_dit

        config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=1,
            Bn_compute_blocks=0,
            max_warmup_steps=0,
            num_inference_steps=STEPS,
            steps_computation_mask=[int(i in COMPUTE_STEPS) for i in range(STEPS)],
            steps_computation_policy="static",
            enable_separate_cfg=False,
        )
        cache_dit.enable_cache(self.model, cache_config=copy.deepcopy(config))
        # A fresh context per run, so its step counter starts at the run's first call like the mask's indices.
        self.begin = lambda: cache_dit.refresh_context(self.model, cache_config=copy.deepcopy(config))

    def run(self, outputs: list[torch.Tensor] | None = None) -> list[int]:
        self.begin()
        model, kwargs, ns = self.model, self.kwargs, []
        clock = time.perf_counter_ns
        with torch.no_grad():
            for timestep in self.times:
                start = clock()
                out = model(timestep=timestep, **kwargs)
                ns.append(clock() - start)
                if outputs is not None:
                    outputs.append(out[0])
        return ns

    def blocks_called(self) -> list[int]:
        """Per call of one run, how many of the blocks after the first computed (checks what the cache skips)."""
        count = [0]

        def counted(*_: Any) -> None:
            count[0] += 1

        # A block's first norm runs only when the block computes, whatever hooks sit on the block itself.
        blocks = [*self.model.transformer_blocks, *self.model.single_transformer_blocks][1:]
        handles = [(b.norm1 if hasattr(b, "norm1") else b.norm).register_forward_pre_hook(counted) for b in blocks]
        counts = []
        try:
            self.begin()
            with torch.no_grad():
                for timestep in self.times:
                    count[0] = 0
                    self.model(timestep=timestep, **self.kwargs)
                    counts.append(count[0])
        finally:
            for handle in handles:
                handle.remove()
        return counts


def _returns_its_inputs(hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, **_: Any) -> Any:
    return encoder_hidden_states, hidden_states  # FLUX's blocks return (encoder, hidden)


def profile_cached(subject: Subject, runs: int, top: int) -> dict[str, Any]:
    """cProfile of ``runs`` runs: the cached calls' functions (every call's, without a cache), by own and by
    cumulative time, in µs per profiled call."""
    profile = cProfile.Profile()
    profiled = 0
    every = not any(subject.cached)
    with torch.no_grad():
        for _ in range(runs):
            subject.begin()
            for i, timestep in enumerate(subject.times):
                if every or subject.cached[i]:
                    profile.enable()
                    subject.model(timestep=timestep, **subject.kwargs)
                    profile.disable()
                    profiled += 1
                else:
                    subject.model(timestep=timestep, **subject.kwargs)
    stats = pstats.Stats(profile).strip_dirs()  # file names only: no install paths in the results
    rows = []
    by_file: dict[str, float] = {}
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        label = f"{file}:{line}({name})"
        rows.append((label, ncalls / profiled, 1e6 * tottime / profiled, 1e6 * cumtime / profiled))
        by_file[file] = by_file.get(file, 0.0) + 1e6 * tottime / profiled

    def table(key: int) -> list[dict[str, Any]]:
        ordered = sorted(rows, key=lambda r: -r[key])[:top]
        return [{"function": r[0], "calls": round(r[1], 2), "self_us": round(r[2], 2), "cum_us": round(r[3], 2)}
                for r in ordered]  # fmt: skip

    return {
        "profiled_calls": "every call" if every else "cached calls",
        "calls": profiled,
        "total_us_per_call": round(sum(r[2] for r in rows), 1),
        "by_self_time": table(2),
        "by_cumulative_time": table(3),
        "self_us_by_file": {f: round(t, 1) for f, t in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]},
    }


def worker(variant: str, threads: int) -> None:
    """Serve the parent's requests on this process's stdout (everything else printed goes to stderr)."""
    torch.set_num_threads(threads)
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # library prints must not garble the protocol
    blocks = {"large": LARGE} if variant in ("diffusers", "diffusers 1-block") else {"large": LARGE, "small": SMALL}
    if variant == "diffusers 1-block":
        blocks = {"large": (1, 0)}
    subjects = {name: Subject(variant, shape) for name, shape in blocks.items()}

    def send(value: Any) -> None:
        reply.write(_REPLY + json.dumps(value) + "\n")
        reply.flush()

    send({"ready": True, "info": library_info(variant)})
    for line in sys.stdin:
        request = json.loads(line)
        if request["do"] == "round":
            gc.collect()
            send({name: [s.run() for _ in range(request["runs"])] for name, s in subjects.items()})
        elif request["do"] == "check":
            outputs: list[torch.Tensor] = []
            subjects["large"].run(outputs)
            digest = hashlib.sha256(b"".join(o.contiguous().numpy().tobytes() for o in outputs)).hexdigest()
            large = subjects["large"]
            send({"sha256": digest, "blocks_called": large.blocks_called(), "cached": large.cached})
        elif request["do"] == "profile":
            send(profile_cached(subjects["large"], request["runs"], request["top"]))
        elif request["do"] == "exit":
            return


def library_info(variant: str) -> str:
    if variant.startswith("diffusers"):
        import diffusers

        return f"diffusers {diffusers.__version__}"
    if variant == "cache-dit":
        from importlib.metadata import version

        return f"cache-dit {version('cache-dit')}"
    import fastdit

    src = Path(fastdit.__file__).resolve().parents[1]

    def git(*command: str) -> str:
        return subprocess.run(["git", "-C", str(src), *command], capture_output=True, text=True, check=True).stdout

    try:  # the checkout's commit, never its path
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", ".").strip()
    except (OSError, subprocess.CalledProcessError):
        return "fastdit"
    return f"fastdit {commit}{'+changes' if dirty else ''}"


# --- the parent: start the workers, take turns, report ---


class Worker:
    """One variant's process and its request/reply lines."""

    def __init__(self, variant: str, src: Path | None, threads: int) -> None:
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH", "")])])
        self.variant = variant
        self.log: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 - open for the worker's life, closed in close()
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", variant, "--threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.info = ""

    def start(self) -> None:
        """Wait for the worker to be ready (its model built)."""
        self.info = self.receive()["info"]

    def ask(self, **request: Any) -> Any:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.receive()

    def receive(self) -> Any:
        for line in self.process.stdout:
            if line.startswith(_REPLY):
                return json.loads(line[len(_REPLY) :])
        self.log.seek(0)
        raise RuntimeError(f"worker {self.variant!r} ended:\n{self.log.read()[-4000:]}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # the worker's loop ends with its input
            self.process.wait(timeout=60)
        self.log.close()


def cache_dit_available() -> bool:
    try:
        import cache_dit  # noqa: F401
    except ImportError:
        return False
    return True


def median_us(values: list[int]) -> float | None:
    return round(statistics.median(values) / 1e3, 1) if values else None


def summarize(variant: str, samples: dict[str, list[list[int]]], cached: list[bool]) -> dict[str, Any]:
    """Medians per kind of call (the first call of a run, which computes with no cache yet, is left out)."""
    out: dict[str, Any] = {}
    for model, runs in samples.items():
        calls = [(i, ns) for run in runs for i, ns in enumerate(run) if i > 0]
        out[model] = {
            "cached_call_us": median_us([ns for i, ns in calls if cached[i]]),
            "computed_call_us": median_us([ns for i, ns in calls if not cached[i]]),
            "cached_calls": sum(cached[i] for i, _ in calls),
            "computed_calls": sum(not cached[i] for i, _ in calls),
        }
    small, large = out.get("small"), out["large"]
    if small is not None and small["cached_call_us"] is not None:
        skipped = (sum(LARGE) - 1) - (sum(SMALL) - 1)
        out["per_skipped_block_us"] = round((large["cached_call_us"] - small["cached_call_us"]) / skipped, 2)
    return out


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args.worker, args.threads)
        return
    here = Path(__file__).resolve().parent
    wanted = args.variants.split(",")
    sources: dict[str, Path | None] = {}
    for variant in wanted:
        if variant not in VARIANTS:
            raise SystemExit(f"--variants: unknown {variant!r}; choose from {VARIANTS}")
        if variant == "fastdit (before)" and args.baseline_src is None:
            continue
        if variant == "cache-dit" and not cache_dit_available():
            print("cache-dit is not installed: its anchor is left out")
            continue
        sources[variant] = args.baseline_src.resolve() if variant == "fastdit (before)" else here.parent / "src"
    workers = [Worker(v, src, args.threads) for v, src in sources.items()]  # they start side by side
    for w in workers:
        w.start()
    for w in workers:
        if w.variant == "fastdit (before)" and args.baseline_label:
            w.info = f"fastdit {args.baseline_label}"
        if w.variant == "fastdit" and args.label:  # a copied tree's git state may not be the checkout's
            w.info = f"fastdit {args.label}"
    try:
        checks = {w.variant: w.ask(do="check") for w in workers}
        for w in workers:
            w.ask(do="round", runs=args.warmup)
        samples: dict[str, dict[str, list[list[int]]]] = {w.variant: {} for w in workers}
        start = time.perf_counter()
        for r in range(args.rounds):
            order = workers if r % 2 == 0 else workers[::-1]  # neither goes first every time
            for w in order:
                # A call that computes every block is measured well enough in fewer runs (and costs 20 cached ones).
                runs_now = 1 if w.variant == "diffusers" else args.runs
                for model, runs in w.ask(do="round", runs=runs_now).items():
                    samples[w.variant].setdefault(model, []).extend(runs)
        elapsed = time.perf_counter() - start
        profiles = {
            w.variant: w.ask(do="profile", runs=args.profile_runs, top=args.top)
            for w in workers
            if w.variant != "diffusers"
        }
    finally:
        for w in workers:
            w.close()
    results = {w.variant: {"library": w.info, **summarize(w.variant, samples[w.variant], checks[w.variant]["cached"])}
               for w in workers}  # fmt: skip
    verify(checks, results)
    floor_gaps(results)
    report(results, profiles, checks, args, elapsed)


def verify(checks: dict[str, Any], results: dict[str, Any]) -> None:
    """The caches skip what they claim to; the fastdit checkouts' outputs are bit for bit equal."""
    for variant, check in checks.items():
        cached = check["cached"]
        called = check["blocks_called"]
        if variant.startswith("fastdit") or variant in ("cache-dit", "diffusers pass-through"):
            wrong = [i for i, (c, n) in enumerate(zip(cached, called, strict=True)) if c != (n == 0)]
            if wrong:
                raise SystemExit(f"{variant}: calls {wrong} did not skip (or compute) as the mask says: {called}")
    hashes = {v: c["sha256"] for v, c in checks.items() if v.startswith("fastdit")}
    for variant in results:
        if variant in hashes:
            results[variant]["outputs_sha256"] = hashes[variant]
    if len(set(hashes.values())) > 1:
        raise SystemExit(f"the fastdit checkouts' outputs differ: {hashes}")


def floor_gaps(results: dict[str, Any]) -> None:
    """What fastdit adds to the pass-through floor (the same model and loop, blocks that return their inputs)."""
    floor = results.get("diffusers pass-through")
    if floor is None:
        return
    for variant, r in results.items():
        if variant.startswith("fastdit") and r["large"]["cached_call_us"] is not None:
            r["cached_call_over_floor_us"] = round(r["large"]["cached_call_us"] - floor["large"]["cached_call_us"], 1)
            if "per_skipped_block_us" in r and "per_skipped_block_us" in floor:
                r["per_skipped_block_over_floor_us"] = round(
                    r["per_skipped_block_us"] - floor["per_skipped_block_us"], 2
                )


def report(
    results: dict[str, Any], profiles: dict[str, Any], checks: dict[str, Any], args: argparse.Namespace, elapsed: float
) -> None:
    from fastdit.bench import json_ready, markdown_table
    from fastdit.io import write_json

    cpu = platform.processor() or platform.machine()
    print(
        f"\nCPU host time, tiny {sum(LARGE)}-block FLUX-structured model, DBCache F1B0 on a static mask "
        f"({STEPS} steps, {len(COMPUTE_STEPS)} computed); {cpu}, torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.rounds} rounds in {elapsed:.0f} s\n"
    )
    header = (
        "variant",
        "library",
        "cached call µs",
        "over the floor µs",
        "per skipped block µs",
        "over the floor µs/block",
        "cached call µs (4 blocks)",
        "computed call µs",
        "calls (cached / computed)",
    )
    cells = []
    for variant, r in results.items():
        large, small = r["large"], r.get("small") or {}
        cells.append(
            (
                variant,
                r["library"],
                large["cached_call_us"] or "-",
                r.get("cached_call_over_floor_us", "-"),
                r.get("per_skipped_block_us", "-"),
                r.get("per_skipped_block_over_floor_us", "-"),
                small.get("cached_call_us") or "-",
                large["computed_call_us"] or "-",
                f"{large['cached_calls']} / {large['computed_calls']}",
            )
        )
    print(markdown_table(header, cells, numeric=(False, False, *[True] * 6, False)), end="")
    if sum("outputs_sha256" in r for r in results.values()) > 1:
        print("\nfastdit outputs: bit for bit equal across checkouts")
    for variant, profile in profiles.items():
        print(
            f"\ncProfile, {variant} ({profile['profiled_calls']}): {profile['total_us_per_call']} µs of own time per "
            "call under the profiler, by own time:"
        )
        top = [(p["function"], p["calls"], p["self_us"], p["cum_us"]) for p in profile["by_self_time"][:12]]
        print(markdown_table(("function", "calls per call", "own µs", "cumulative µs"), top), end="")
    out = args.out or (Path(os.environ["OUT"]) / "host_cached_step.json" if "OUT" in os.environ else None)
    if out is None:
        return
    config = {
        "steps": STEPS,
        "compute_steps": COMPUTE_STEPS,
        "blocks": LARGE,
        "slope_against": SMALL,
        "rounds": args.rounds,
        "runs_per_round": args.runs,
        "threads": args.threads,
        "profile_runs": args.profile_runs,
    }
    payload = {
        "benchmark": "host_cached_step",
        "date": date.today().isoformat(),
        "device": "CPU host time, tiny 57-block FLUX-structured model",
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "config": config,
        "elapsed_s": round(elapsed, 1),
        "results": results,
        "blocks_called_per_call": {v: c["blocks_called"] for v, c in checks.items()},
        "profiles": profiles,
    }
    write_json(out, json_ready(payload))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
