"""`embodied-kv gpu-check` (`make gpu-check`): the CUDA path, end to end, on a GPU machine.

    1. without CUDA: one line saying so, exit 2;
    2. the whole test suite (the graph replay tests then run in "cuda" mode too; the ROS
       tests skip, each with its reason, where rclpy is not installed);
    3. `bench latency`, `step`, `oxygen`, `capsule`, `keep` at --preset pi05 --device cuda
       (keep: random pi05 weights, TTFT only);
    4. `lerobot`: `bench latency --peer lerobot`, LeRobot's PI05Policy beside ours in one
       process, eager, then under torch.compile (mode PEER_COMPILE), each a step of its own
       with its own time limit. It needs LeRobot's wheels carried to the machine
       (scripts/peer_wheels.sh; scripts/gpu_check.sh installs them into a folder that only
       these steps read, EMBODIED_KV_PEER_SITE); without them the step says so and is skipped.

Everything lands in bench/results/<date>-<gpu>/: env.json (device, driver, CUDA, torch,
triton, Python, date, commit), pytest.txt, <bench>.json and <bench>.txt, summary.json
(exit status and seconds of every step). Exit 0 only when every step passed.

Nothing is installed: a GPU machine keeps the torch it has (a pip-resolved torch would
replace its CUDA build). A missing module is named with the pip command that adds it.

`--profile mechanisms` (`make gpu-check-mechanisms`): instead, every seed's mechanism
(oxygen, actionflow, vlcache, keep, capsule) at pi05 in a GPU-quick form with a time
budget each, no test suite, < 8 minutes (bench/mechanisms.py); each JSON is checked for
the fields the profile promises. `--dry`: the same benches at --preset tiny on the CPU
(no CUDA needed), the check the CI runs so the GPU run cannot crash for a reason the CPU
could have shown. docs/gpu_mechanisms.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from embodied_kv.bench import mechanisms

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ("latency", "step", "oxygen", "capsule", "keep", "lerobot")
PEER_COMPILE = "default"  # LeRobot's own default, max-autotune, autotunes for many minutes
PEER_STEPS = {  # step -> `bench latency` arguments beyond --preset pi05 --device cuda
    "latency_lerobot": ["--peer", "lerobot"],
    "latency_lerobot_compiled": ["--peer", "lerobot", "--peer-compile", PEER_COMPILE],
}
PEER_TIMEOUT_S = 300  # each peer step, where --timeout gives none
# module -> PyPI name: what the tests and benchmarks import besides torch (no ROS)
REQUIRED = {
    "numpy": "numpy",
    "safetensors": "safetensors",
    "transformers": "transformers",
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "yaml": "PyYAML",
    "matplotlib": "matplotlib",
    "triton": "triton",
}


def environment(device: str | torch.device = "cuda") -> dict:
    """What a result was measured on. Works on a CPU too (no driver, no CUDA)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    # a copied working tree (a device machine's) names its commit: its .git may be stale
    given = os.environ.get("EMBODIED_KV_COMMIT")
    head = None if given else _git("rev-parse", "HEAD")
    props = torch.cuda.get_device_properties(device) if cuda else None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "memory_gib": round(props.total_memory / 2**30, 1) if cuda else None,
        "driver": _nvidia_smi("driver_version") if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": given or head,
        "dirty": None if head is None else bool(_git("status", "--porcelain")),
    }


def results_dir(root: Path, env: dict) -> Path:
    """root/<YYYY-MM-DD>-<device slug>, e.g. bench/results/2026-11-22-nvidia-h100-80gb-hbm3."""
    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-") or "device"
    return root / f"{env['date'][:10]}-{slug}"


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def missing_modules() -> list[str]:
    return [pypi for mod, pypi in REQUIRED.items() if importlib.util.find_spec(mod) is None]


def run_logged(
    cmd: list[str], log: Path, timeout: float = 0, env: dict | None = None
) -> tuple[int, float]:
    """Run cmd in the repository root, its output both shown and kept in `log` as it comes;
    past `timeout` seconds (0: none) it is killed and its status is 124 (as timeout(1))."""
    t = time.perf_counter()
    env = {**(env or os.environ), "PYTHONUNBUFFERED": "1"}
    with log.open("w") as f, subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        timer = threading.Timer(timeout, proc.kill) if timeout > 0 else None
        if timer:
            timer.start()
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
            f.flush()
        proc.wait()
        killed = timer is not None and not timer.is_alive() and proc.returncode < 0
        if timer:
            timer.cancel()
    if killed:
        with log.open("a") as f:
            f.write(f"gpu-check: killed after {timeout:.0f} s\n")
        return 124, round(time.perf_counter() - t, 1)
    return proc.returncode, round(time.perf_counter() - t, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embodied-kv gpu-check", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    p.add_argument("--bench-args", default="", help="extra benchmark arguments, e.g. --quick")
    p.add_argument("--only", default=",".join(BENCHES), help="benchmarks to run, comma-separated")
    p.add_argument("--timeout", type=float, default=0, help="seconds per step (0: none)")
    p.add_argument("--profile", choices=["latency", "mechanisms"], default="latency",
                   help="latency: tests + the latency benches (default); mechanisms: every "
                   "seed's mechanism, GPU-quick, a budget each (bench/mechanisms.py)")
    p.add_argument("--dry", action="store_true", help="mechanisms on the CPU at --preset "
                   "tiny: shapes, graph capture in emulation, JSON fields (CI)")
    args = p.parse_args(argv)
    if args.dry and args.profile != "mechanisms":
        p.error("--dry runs the mechanisms profile: add --profile mechanisms")
    if args.profile == "mechanisms":
        return run_mechanisms(args)

    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device visible to torch {torch.__version__} "
            f"(CUDA build: {torch.version.cuda or 'none'}); run it on a machine with an NVIDIA GPU",
            file=sys.stderr,
        )
        return 2
    missing = missing_modules()
    if missing:
        print(
            f"gpu-check: missing {', '.join(missing)}; add them without touching torch: "
            f"{sys.executable} -m pip install {' '.join(missing)}",
            file=sys.stderr,
        )
        return 2

    env = environment("cuda")
    out = results_dir(args.out, env)
    write_json(out / "env.json", env)
    steps = {}
    if not args.skip_tests:
        cmd = [sys.executable, "-m", "pytest", "-q", *args.pytest_args.split()]
        steps["pytest"] = run_logged(cmd, out / "pytest.txt", args.timeout)
    notes = {}
    for name in [n for n in args.only.split(",") if n]:  # --only= : the tests alone
        if name == "lerobot":
            notes.update(peer_steps(args, out, steps))
            continue
        cmd = [sys.executable, "-m", "embodied_kv.cli", "bench", name, "--preset", "pi05"]
        cmd += ["--device", "cuda", "--json", str(out / f"{name}.json"), *args.bench_args.split()]
        steps[f"bench {name}"] = run_logged(cmd, out / f"{name}.txt", args.timeout)
    summary = {k: {"returncode": rc, "seconds": s} for k, (rc, s) in steps.items()}
    for k, note in notes.items():
        summary.setdefault(k, {"returncode": None, "seconds": 0})["note"] = note
    write_json(out / "summary.json", {"env": env, "steps": summary})
    for k, note in notes.items():
        print(f"gpu-check: {k}: {note}")
    failed = [k for k, (rc, _) in steps.items() if rc != 0]
    failed += [k for k in notes if k in steps and steps[k][0] == 0]  # ran, LeRobot did not
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all passed"
    print(f"gpu-check: results in {out}; {verdict}")
    return 1 if failed else 0


def peer_steps(args: argparse.Namespace, out: Path, steps: dict) -> dict[str, str]:
    """LeRobot's steps (PEER_STEPS) into `steps`, each with LeRobot's own folder first on
    its path -> {step: why LeRobot was not measured} (skipped, or its JSON says so)."""
    site = os.environ.get("EMBODIED_KV_PEER_SITE")
    if not site:
        why = ("skipped: no LeRobot wheels on this machine (scripts/peer_wheels.sh here, then "
               "carry .peer_wheels to the device; docs/gpu.md)")  # fmt: skip
        return dict.fromkeys(PEER_STEPS, why)
    path = [str(ROOT), site, *[p for p in os.environ.get("PYTHONPATH", "").split(":") if p]]
    env = {**os.environ, "PYTHONPATH": ":".join(dict.fromkeys(path))}
    notes = {}
    for name, extra in PEER_STEPS.items():
        cmd = [sys.executable, "-m", "embodied_kv.cli", "bench", "latency", "--preset", "pi05",
               "--device", "cuda", "--json", str(out / f"{name}.json"), *extra,
               *args.bench_args.split()]  # fmt: skip
        steps[name] = run_logged(cmd, out / f"{name}.txt", args.timeout or PEER_TIMEOUT_S, env)
        if steps[name][0] == 0:
            peer = json.loads((out / f"{name}.json").read_text()).get("peer") or {}
            if peer.get("unavailable"):
                notes[name] = f"LeRobot not measured: {peer['unavailable']}"
    return notes


def run_inline(cli_argv: list[str], log: Path) -> tuple[int, float]:
    """`embodied-kv <cli_argv>` in this process, its output kept in `log` -> (status: 1 on
    an exception, its traceback logged; seconds)."""
    import contextlib
    import traceback

    from embodied_kv import cli

    t = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            rc = cli.main(cli_argv) or 0
        except SystemExit as e:  # argparse refused the arguments
            rc = e.code if isinstance(e.code, int) else 2
        except Exception:  # noqa: BLE001 - a bench's failure is the step's status
            traceback.print_exc()
            rc = 1
    return rc, round(time.perf_counter() - t, 1)


def run_mechanisms(args: argparse.Namespace) -> int:
    """The mechanisms profile (or its dry twin): each bench within its budget, its JSON
    checked; summary.json says per bench status, seconds, budget and what is missing."""
    if not args.dry and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device visible to torch {torch.__version__} (CUDA build: "
              f"{torch.version.cuda or 'none'}); --dry runs the profile on the CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    env = environment("cpu" if args.dry else "cuda")
    out = results_dir(args.out, env)
    if args.dry:
        out = out.with_name(out.name + "-dry")
    write_json(out / "env.json", env)
    only = set(args.only.split(",")) if args.only != ",".join(BENCHES) else None
    benches = [b for b in mechanisms.PROFILE if only is None or b.name in only]
    if only is not None and (unknown := only - {b.name for b in mechanisms.PROFILE}):
        print(f"gpu-check: --only {sorted(unknown)}: the mechanisms profile runs "
              f"{[b.name for b in mechanisms.PROFILE]}", file=sys.stderr)  # fmt: skip
        return 2
    steps = {}
    for b in benches:
        budget = args.timeout or (mechanisms.DRY_BUDGET_S if args.dry else b.budget_s)
        cmd = mechanisms.command(b, sys.executable, out, args.dry) + args.bench_args.split()
        if args.dry:  # in this process: the benches' imports once, not once each (~15 s)
            rc, seconds = run_inline(cmd[3:], out / f"{b.name}.txt")
        else:
            rc, seconds = run_logged(cmd, out / f"{b.name}.txt", budget)
        problem = mechanisms.check(b, out, args.dry) if rc == 0 else None
        steps[b.name] = {"returncode": rc, "seconds": seconds, "budget_s": budget,
                         "command": " ".join(cmd[1:]), "fields_missing": problem,
                         "hf_compiled": mechanisms.SKIPPED_HF}  # fmt: skip
        if rc == 124:
            print(f"gpu-check: bench {b.name} killed at its budget, {budget:.0f} s")
    write_json(out / "summary.json", {"env": env, "profile": "mechanisms", "dry": args.dry,
                                      "steps": steps})  # fmt: skip
    failed = [k for k, s in steps.items() if s["returncode"] != 0 or s["fields_missing"]]
    for k in failed:
        s = steps[k]
        print(f"gpu-check: {k}: status {s['returncode']}; {s['fields_missing'] or 'see its .txt'}")
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all passed"
    print(f"gpu-check: mechanisms{' (dry)' if args.dry else ''}: results in {out}; {verdict}")
    return 1 if failed else 0


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
