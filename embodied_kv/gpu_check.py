"""`embodied-kv gpu-check` (`make gpu-check`): the CUDA path on a GPU machine.

Profiles (`--profile`):

    action      (the default) issue #33's measurement in one device call under 8 minutes
                (bench/action_profile.py): action latency at pi05 with its breakdown and
                top kernels, LeRobot's PI05Policy in the same rounds, every Triton kernel's
                registers and spills as this machine's Triton compiles them, the CUDA tests
                of the action path, LeRobot under torch.compile last
    mechanisms  every seed's mechanism (oxygen, actionflow, vlcache, keep, capsule) at pi05
                in a GPU-quick form, a budget each, < 8 minutes (bench/mechanisms.py)
    full        the whole test suite (the graph replay tests then run in "cuda" mode too;
                the ROS tests skip, each with its reason, where rclpy is not installed),
                then `bench latency`, `step`, `oxygen`, `capsule`, `keep` at --preset pi05
                --device cuda: several device calls (`--only`, `--skip-tests`, `--timeout`)

Without CUDA: one line saying so, exit 2. Everything lands in bench/results/<date>-<gpu>/:
env.json (device, driver, CUDA, torch, triton, Python, date, commit), a log and a JSON per
step, summary.json (status, seconds, budget and missing fields of every step). Exit 0
only when every step passed.

Nothing is installed: a GPU machine keeps the torch it has (a pip-resolved torch would
replace its CUDA build). A missing module is named with the pip command that adds it.
LeRobot's wheels, where a device call carried them, scripts/gpu_check.sh installs into a
folder of their own (EMBODIED_KV_PEER_SITE) that only the steps marked `peer` read.

`--dry` (action or mechanisms): the same steps at --preset tiny on the CPU (no CUDA needed),
the check the CI runs so the GPU run cannot crash for a reason the CPU could have shown.
docs/gpu.md, docs/gpu_mechanisms.md.
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

from embodied_kv.bench import action_profile, mechanisms

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ("latency", "step", "oxygen", "capsule", "keep")  # the full profile's
PROFILES = {"action": action_profile, "mechanisms": mechanisms}  # steps with a budget each
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
    p.add_argument("--profile", choices=["action", "mechanisms", "full"], default="action",
                   help="action (default): issue #33's measurement, < 8 min; mechanisms: every "
                   "seed's mechanism, < 8 min; full: tests + the latency benches, several "
                   "calls (module docstring)")
    p.add_argument("--dry", action="store_true", help="the action or mechanisms profile on "
                   "the CPU at --preset tiny: shapes, graph capture in emulation, JSON fields")
    args = p.parse_args(argv)
    if args.dry and args.profile == "full":
        p.error("--dry runs the action or mechanisms profile (--profile action|mechanisms)")
    if args.profile in PROFILES:
        return run_profile(args)

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
    for name in [n for n in args.only.split(",") if n]:  # --only= : the tests alone
        cmd = [sys.executable, "-m", "embodied_kv.cli", "bench", name, "--preset", "pi05"]
        cmd += ["--device", "cuda", "--json", str(out / f"{name}.json"), *args.bench_args.split()]
        steps[f"bench {name}"] = run_logged(cmd, out / f"{name}.txt", args.timeout)
    summary = {k: {"returncode": rc, "seconds": s} for k, (rc, s) in steps.items()}
    write_json(out / "summary.json", {"env": env, "profile": "full", "steps": summary})
    failed = [k for k, (rc, _) in steps.items() if rc != 0]
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all passed"
    print(f"gpu-check: results in {out}; {verdict}")
    return 1 if failed else 0


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


def peer_env() -> dict | None:
    """The environment of a step that runs LeRobot: its wheels' folder on the path after the
    repository (None: no wheels were carried and installed)."""
    site = os.environ.get("EMBODIED_KV_PEER_SITE")
    if not site:
        return None
    path = [str(ROOT), site, *[p for p in os.environ.get("PYTHONPATH", "").split(":") if p]]
    return {**os.environ, "PYTHONPATH": ":".join(dict.fromkeys(path))}


NO_PEER = ("skipped: no LeRobot wheels on this machine (scripts/peer_wheels.sh here, then "
           "carry .peer_wheels to the device; docs/gpu.md)")  # fmt: skip


def run_profile(args: argparse.Namespace) -> int:
    """A profile of budgeted steps (action, mechanisms) or its dry twin: each step within
    its budget, its JSON checked; summary.json says per step status, seconds, budget and
    what is missing."""
    module = PROFILES[args.profile]
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
    names = [s.name for s in module.PROFILE]
    only = set(args.only.split(",")) if args.only != ",".join(BENCHES) else None
    if only is not None and (unknown := only - set(names)):
        print(f"gpu-check: --only {sorted(unknown)}: the {args.profile} profile runs {names}",
              file=sys.stderr)  # fmt: skip
        return 2
    steps = {}
    # --only names the steps; without it, all but those run on request only
    for b in [b for b in module.PROFILE
              if (b.name in only if only is not None else not getattr(b, "on_request", False))]:
        budget = args.timeout or (module.DRY_BUDGET_S if args.dry else b.budget_s)
        cmd = module.command(b, sys.executable, out, args.dry)
        if cmd is None:
            steps[b.name] = {"returncode": None, "seconds": 0, "budget_s": budget,
                             "skipped": "no dry form (a GPU alone runs it)"}  # fmt: skip
            continue
        if "bench" in cmd:
            cmd += args.bench_args.split()
        run_env = peer_env() if getattr(b, "peer", False) else None
        if getattr(b, "compiles", False):
            run_env = {k: v for k, v in (run_env or os.environ).items() if k != "TRITON_INTERPRET"}
        elif args.dry:  # a dry step's kernels run on CPU tensors: the interpreter
            run_env = {**(run_env or os.environ), "TRITON_INTERPRET": "1"}
        if getattr(b, "needs_peer", False) and run_env is None:
            steps[b.name] = {"returncode": None, "seconds": 0, "budget_s": budget,
                             "command": " ".join(cmd[1:]), "skipped": NO_PEER}  # fmt: skip
            print(f"gpu-check: {b.name}: {NO_PEER}")
            continue
        if args.dry and cmd[1:4] == ["-m", "embodied_kv.cli", "bench"]:
            # in this process: the benches' imports once, not once each (~15 s)
            rc, seconds = run_inline(cmd[3:], out / f"{b.name}.txt")
        else:
            rc, seconds = run_logged(cmd, out / f"{b.name}.txt", budget, run_env)
        problem = module.check(b, out, args.dry) if rc == 0 else None
        steps[b.name] = {"returncode": rc, "seconds": seconds, "budget_s": budget,
                         "command": " ".join(cmd[1:]), "fields_missing": problem}  # fmt: skip
        if args.profile == "mechanisms":
            steps[b.name]["hf_compiled"] = mechanisms.SKIPPED_HF
        if rc == 124:
            print(f"gpu-check: {b.name} killed at its budget, {budget:.0f} s")
    write_json(out / "summary.json", {"env": env, "profile": args.profile, "dry": args.dry,
                                      "steps": steps})  # fmt: skip
    failed = [k for k, s in steps.items()
              if s["returncode"] not in (0, None) or s.get("fields_missing")]  # fmt: skip
    for k in failed:
        s = steps[k]
        print(f"gpu-check: {k}: status {s['returncode']}; {s['fields_missing'] or 'see its .txt'}")
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all passed"
    print(f"gpu-check: {args.profile}{' (dry)' if args.dry else ''}: results in {out}; {verdict}")
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
