"""The one way every benchmark sets up, times and records a run.

    args = harness.parse(parser, argv)    # --preset --device --quick --json --threads ...
    env = harness.Environment.start(args, argv)   # threads set, load and command recorded
    stats = harness.interleave({"hf": f, "ours": g}, env.device, warmup=1, repeats=9)
    harness.finish(result, env, args.json)        # environment + result -> atomic JSON

Every timing reads `embodied_kv.timing` (a clock that synchronizes CUDA first). Baseline
and candidate repeats are interleaved round-robin (ABAB..., not AAAA..BBBB) so a burst of
load from another process hits both sides alike; ratios are taken per round and their
median reported, which is what keeps two runs on a shared, busy machine within 25 %.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from embodied_kv.bench.report import device_name, set_cpu_threads, write_json
from embodied_kv.timing import device_clock, elapsed_ms


def add_common_args(p: argparse.ArgumentParser, quick_help: str = "< 60 s on a 2-core CPU"):
    """The flags every benchmark takes, with the same defaults everywhere."""
    p.add_argument("--preset", choices=["tiny", "pi05"], default="tiny")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--json", metavar="PATH", help="write the result (and its environment) here")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU intra-op threads (default 1: see bench/report.set_cpu_threads)",
    )
    p.add_argument("--allow-cpu-pi05", action="store_true", help="run pi05 on a CPU anyway")


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse with the common checks: a CUDA device that exists, no pi05 on a CPU by accident,
    threads >= 1."""
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.device == "cpu" and args.preset == "pi05" and not args.allow_cpu_pi05:
        p.error(
            "pi05 on a CPU needs ~13 GB in fp32 and minutes per step; use --device cuda, "
            "--preset tiny, or pass --allow-cpu-pi05"
        )
    if args.threads < 1:
        p.error(f"--threads {args.threads} must be >= 1")
    return args


def progress(env: Environment, what: str) -> None:
    """One line on stderr with the seconds since the bench started: a long run (pi05 on a
    GPU, a killed step in gpu-check) shows where its time went."""
    print(f"[{time.perf_counter() - env.started:7.1f} s] {what}", file=sys.stderr, flush=True)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


@dataclass
class Environment:
    """What a result depends on besides the code: recorded in every JSON."""

    device: str  # torch device string the bench runs on
    device_name: str
    threads: int  # torch intra-op threads
    command: str  # the exact command line of the process (python + sys.argv)
    bench_argv: list  # the arguments the bench itself parsed
    load_start: list  # os.getloadavg(): 1, 5, 15 min averages
    versions: dict
    started: float  # perf_counter at start

    @classmethod
    def start(cls, args: argparse.Namespace, argv: Sequence[str] | None) -> Environment:
        set_cpu_threads(args.threads)
        torch.manual_seed(0)
        return cls(
            device=args.device,
            device_name=device_name(args.device),
            threads=torch.get_num_threads(),
            command=shlex.join([sys.executable, *sys.argv]),
            bench_argv=list(sys.argv[1:] if argv is None else argv),
            load_start=list(os.getloadavg()),
            versions=versions(),
            started=time.perf_counter(),
        )

    def record(self) -> dict:
        d = asdict(self)
        d.pop("started")
        d["load_end"] = list(os.getloadavg())
        d["cpu_count"] = os.cpu_count()
        d["wall_s"] = time.perf_counter() - self.started
        return d


@dataclass(frozen=True)
class Stats:
    """Summary of repeated timings, ms."""

    median: float
    p10: float
    p90: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        if not samples:
            raise ValueError("no samples to summarise")
        s = sorted(samples)
        return cls(statistics.median(s), quantile(s, 0.1), quantile(s, 0.9), len(s))

    def as_dict(self) -> dict:
        return asdict(self)


def quantile(sorted_samples: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted samples."""
    x = (len(sorted_samples) - 1) * q
    lo = int(x)
    hi = min(lo + 1, len(sorted_samples) - 1)
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * (x - lo)


def time_once(fn: Callable[[], object], device: str | torch.device, cpu: str = "wall") -> float:
    clock = device_clock(device, cpu)
    t = clock()
    fn()
    return elapsed_ms(t, clock)


def interleave_calls(
    fns: dict[str, Callable[[], object]], warmup: int = 1, repeats: int = 5
) -> dict[str, list]:
    """Call every fn `repeats` times, round-robin (one call of each per round, the order
    rotating each round), after `warmup` untimed rounds -> results per name."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    results: dict[str, list] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            results[name].append(fns[name]())
    return results


def interleave(
    fns: dict[str, Callable[[], object]],
    device: str | torch.device,
    warmup: int = 1,
    repeats: int = 5,
    cpu: str = "wall",
) -> dict[str, list[float]]:
    """`interleave_calls` timing each call (on a CPU, with the clock `cpu`) -> ms samples
    per name."""
    timed = {name: (lambda fn=fn: time_once(fn, device, cpu)) for name, fn in fns.items()}
    return interleave_calls(timed, warmup, repeats)


def looped(fn: Callable[[], object], k: int) -> Callable[[], object]:
    """fn called k times per call: for sub-10 ms work on a loaded machine, where one
    preemption by the OS (a scheduler slice) would otherwise be the measurement. Divide
    the timings by k."""

    def run():
        out = None
        for _ in range(k):
            out = fn()
        return out

    return run


def paired_difference(a: Sequence[bool], b: Sequence[bool]) -> tuple[float, float]:
    """Mean of a - b over the same items (shares: accuracy of one method minus another's
    on the same questions) and its standard error (nan below two items); only items where
    the two disagree move either."""
    d = [float(x) - float(y) for x, y in zip(a, b, strict=True)]  # unequal: ValueError
    if not d:
        return float("nan"), float("nan")
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return statistics.fmean(d), se


def ratio(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """Median over rounds of baseline / candidate (paired by round when the counts match,
    else the ratio of medians)."""
    if len(baseline) == len(candidate):
        return statistics.median(b / c for b, c in zip(baseline, candidate, strict=True))
    return statistics.median(baseline) / statistics.median(candidate)


def execute(args: argparse.Namespace, argv, run: Callable, report: Callable) -> int:
    """A bench's main after parsing: start the environment, `run(args, env)` -> result,
    `report(result)`, write the JSON (--json); 0."""
    env = Environment.start(args, argv)
    result = run(args, env)
    report(result)
    finish(result, env, args.json)
    return 0


def finish(result: dict, env: Environment, path: str | None) -> dict:
    """Attach the environment to `result`, write it as JSON if `path`, return it."""
    out = {**result, "environment": env.record()}
    out.setdefault("device", env.device_name)
    if path:
        write_json(out, path)
    return out
