"""`embodied-kv`: the command line.

    embodied-kv demo [--seconds N] [--config PATH] [--preset NAME] [--weights PATH]
    embodied-kv bench NAME [ARGS...]     # runs embodied_kv.bench.NAME.main(ARGS)
    embodied-kv gpu-check [ARGS...]      # tests + pi05 benchmarks on CUDA (gpu_check.py)
    embodied-kv train [--steps N] [--minutes M] [--out DIR] [--seed S]
    embodied-kv eval world [--weights PATH] [--episodes N] [--json PATH]
    embodied-kv eval visited --out FILE [--weights PATH] [--episodes N]   (DAgger states)
    embodied-kv serve [--config YAML] [--preset NAME] [--host H] [--port P] [--layout L]

Imports nothing from ROS until `demo` runs, so `bench` works without rclpy.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

DEFAULT_DEMO_SECONDS = 20.0


def run_demo(args: argparse.Namespace) -> int:
    try:
        from embodied_kv.ros import demo
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in ("rclpy", "yaml", "rcl_interfaces"):
            raise
        print(
            f"embodied-kv demo: needs ROS 2 ({e.name} is not importable); "
            "run `make demo`, which installs it into .venv, or source a ROS 2 install",
            file=sys.stderr,
        )
        return 2
    argv = ["--seconds", str(args.seconds)]
    if args.config:
        argv += ["--config", args.config]
    if args.preset:
        argv += ["--preset", args.preset]
    if args.weights:
        argv += ["--weights", args.weights]
    return demo.main(argv)


def available_benchmarks() -> list[str]:
    import embodied_kv.bench

    return sorted(
        m.name
        for m in pkgutil.iter_modules(embodied_kv.bench.__path__)
        if not m.name.startswith("_")
    )


def run_bench(args: argparse.Namespace) -> int:
    name = args.name.replace("-", "_")
    module_name = f"embodied_kv.bench.{name}"
    if not name.isidentifier():
        print(f"embodied-kv bench: {args.name!r} is not a benchmark name", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        choices = ", ".join(available_benchmarks()) or "none yet"
        print(
            f"embodied-kv bench: no benchmark {args.name!r} (no module {module_name}); "
            f"available: {choices}",
            file=sys.stderr,
        )
        return 2
    entry = getattr(module, "main", None)
    if not callable(entry):
        print(f"embodied-kv bench: {module_name} has no main(argv)", file=sys.stderr)
        return 2
    result = entry(list(args.args))
    return 0 if result is None else int(result)


def run_gpu_check(args: argparse.Namespace) -> int:
    from embodied_kv import gpu_check

    return gpu_check.main(list(args.args))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


# DataConfig fields `train` sets from flags: (flag, type, help); the field is the flag's name
_DATA_FLAGS = (
    ("--memory-objects", int, "containers and movables per fact stream: 2 .. this each "
                              "(default 3)"),
    ("--memory-updates", int, "fact updates after the initial facts: 0 .. this (default 6)"),
    ("--memory-hard", float, "share of memory queries where copying the last named place is "
                             "wrong"),
    ("--text-mix", _floats, "weights of answer,plan,narration,actions samples (default "
                            ".3,.35,.1,.25)"),
    ("--turns", int, "questions / memory queries per answer or plan sample (default 4)"),
    ("--two-hop-share", float, "share of memory queries that need two lookups (default 0.5)"),
    ("--two-hop-answer", str, "place (default) or path: a two-hop answer names the container "
                              "first, 'in the red box on the shelf'"),
    ("--rollout", str, "fixed (default: 0..20 expert steps) or task: only states before the "
                       "expert's success (docs/world_training.md)"),
    ("--first-share", float, "rollout task: share of samples at the episode's first state"),
    ("--arm-start-share", float, "rollout task: share of episodes from a random high arm pose"),
    ("--where-share", float, "share of scene questions 'where is the X ?' (left/middle/right)"),
    ("--visited", str, "DAgger: a file of states the policy visited (`embodied-kv eval "
                       "visited` writes it)"),
    ("--visited-share", float, "share of samples drawn at those states (default 0)"),
    ("--prefix-max", int, "training-time real-time chunking: each sample's first d actions "
                          "(d uniform in 0..N) executed before the chunk, given clean, the "
                          "loss on the rest; for rtc.guidance: prefix (default 0: off)"),
    ("--prefix-detour", float, "share of those samples whose executed actions depart from "
                               "the expert's plan, the rest of the chunk the expert's "
                               "continuation from there (world/executed_prefix.py; default 0)"),
    ("--prefix-free", float, "share of those samples given no held action before the uniform "
                             "draw of d: the plain chunk kept strong (default 0)"),
)  # fmt: skip


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _field(flag: str) -> str:
    return flag[2:].replace("-", "_")


def train_config(args: argparse.Namespace):
    """`embodied-kv train`'s flags -> TrainConfig (ValueError naming a bad value)."""
    from embodied_kv.train.config import TrainConfig
    from embodied_kv.world.dataset import DataConfig

    given = {k: getattr(args, k)
             for k in ("preset", "batch", "buckets", "lr", "threads", "curriculum", "ramp",
                       "warmup",
                       "data_workers", "embed_std", "until", "stop_after", "flow_dims",
                       "ground_weight", "ground_layer", "freeze", "position_weight",
                       "object_weight", "bin_sigma", "bin_weight", "name_weight", "bin_first",
                       "bin_noise")}  # fmt: skip
    data = {_field(flag): getattr(args, _field(flag)) for flag, _, _ in _DATA_FLAGS}
    return TrainConfig(
        out=args.out, steps=args.steps, minutes=args.minutes, seed=args.seed,
        ckpt_every=args.ckpt_every, device=args.device, init=args.init or "",
        resume=args.resume, overwrite=args.overwrite,
        data=DataConfig(**{k: v for k, v in data.items() if v is not None}),
        **{k: v for k, v in given.items() if v is not None},
    )  # fmt: skip


def run_train(args: argparse.Namespace) -> int:
    from embodied_kv.train.loop import run_done, train

    try:
        cfg = train_config(args)
    except ValueError as e:
        print(f"embodied-kv train: {e}", file=sys.stderr)
        return 2
    from embodied_kv.train.resume import ResumeError

    try:
        records = train(cfg)
    except ResumeError as e:
        print(f"embodied-kv train: {e}", file=sys.stderr)
        return 2
    last = records[-1] if records else {}
    print(f"trained {len(records)} steps -> {args.out}; last {last}")
    reached = last.get("step", -1) + 1
    if (cfg.until or cfg.stop_after) and run_done(cfg, reached, last.get("seconds", 0)) < 1:
        print(f"paused before step {reached}: the same command with --resume goes on")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from embodied_kv.eval import visited, world

    suites = {"world": world.main, "visited": visited.main}
    if args.suite not in suites:
        print(f"embodied-kv eval: no suite {args.suite!r}; known: {sorted(suites)}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        return int(suites[args.suite](list(args.args)) or 0)
    except ValueError as e:
        print(f"embodied-kv eval {args.suite}: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embodied-kv", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="the robot process beside a simulated robot for a bounded time, then a report"
    )
    demo.add_argument("--seconds", type=float, default=DEFAULT_DEMO_SECONDS)
    demo.add_argument("--config", help="ROS 2 parameter file (default: config/robot.yaml)")
    demo.add_argument("--preset", help="model preset; overrides the config file")
    demo.add_argument("--weights", help="weights file; overrides the config file")
    demo.set_defaults(run=run_demo)

    bench = commands.add_parser("bench", help="run embodied_kv.bench.NAME")
    bench.add_argument("name", help="benchmark module in embodied_kv/bench/")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark's main")
    bench.set_defaults(run=run_bench)

    gpu = commands.add_parser(
        "gpu-check", help="the test suite, then the pi05 benchmarks on CUDA, results kept"
    )
    gpu.add_argument("args", nargs=argparse.REMAINDER, help="see embodied_kv/gpu_check.py")
    gpu.set_defaults(run=run_gpu_check)

    tr = commands.add_parser("train", help="train the tiny VLA on the synthetic world")
    tr.add_argument("--out", default="out/train", help="weights.safetensors + tokenizer.json")
    tr.add_argument("--preset", help="world (default) or world_smooth (the expert's waypoint "
                    "labels, a 30-action chunk; with --init world weights)")  # fmt: skip
    tr.add_argument("--steps", type=int, default=0, help="0: until --minutes runs out")
    tr.add_argument("--minutes", type=float, default=0.0, help="wall-clock budget (0: none)")
    tr.add_argument("--batch", type=int, help="default: TrainConfig.batch (train/config.py)")
    tr.add_argument("--buckets", type=int,
                    help="length groups a step is split into (default 2; 4: ~13%% faster on "
                         "the long memory streams, the same gradient up to fp32 rounding)")
    tr.add_argument("--lr", type=float, help="default: TrainConfig.lr")
    tr.add_argument("--threads", type=int, help="torch CPU threads (default 1)")
    tr.add_argument("--data-workers", type=int,
                    help="processes rendering the next steps' samples (default 0: in-process; "
                         "a GPU run needs several)")  # fmt: skip
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--device", default="cpu", help="cpu or cuda (fp32 weights either way)")
    tr.add_argument("--ckpt-every", type=int, default=200)
    tr.add_argument("--curriculum", type=int,
                    help="steps of one-hop, unchanging memory facts first")  # fmt: skip
    tr.add_argument("--ramp", type=int,
                    help="steps after the curriculum over which memory updates and the "
                         "two-hop share grow from 0 to their values (default 0: at once)")
    tr.add_argument("--warmup", type=int, help="linear warmup steps (default 100)")
    tr.add_argument("--init", help="weights file to start from (fine-tuning); default: fresh")
    tr.add_argument("--embed-std", type=float,
                    help="std of a fresh text embedding (default 0: the model's 0.02; 0.088 "
                         "= width**-0.5, see `embodied-kv recall-probe`)")  # fmt: skip
    tr.add_argument("--resume", action="store_true",
                    help="continue the run saved in --out (same flags; train/resume.py)")
    tr.add_argument("--overwrite", action="store_true",
                    help="start a new run in an --out that holds one (else refused)")
    tr.add_argument("--until", type=int,
                    help="end this call before this step (the schedule stays --steps')")
    tr.add_argument("--stop-after", type=float,
                    help="end this call after this many minutes, resumable (schedule unchanged)")
    tr.add_argument("--flow-dims", type=int,
                    help="flow loss over the first N action dims (4: the world's real ones; "
                         "default 0: all)")  # fmt: skip
    tr.add_argument("--ground-weight", type=float,
                    help="weight of the training-only grounding head's loss (named movable / "
                         "container / other per patch; default 0: off)")  # fmt: skip
    tr.add_argument("--ground-layer", type=int,
                    help="backbone layers before the grounding head's image rows (default 2)")
    tr.add_argument("--freeze", type=_names,
                    help="model parts that keep their weights, of vision,backbone,expert; "
                         "vision,backbone: the expert alone on the flow loss (pi0.5's "
                         "knowledge insulation: the text skills stay byte for byte)")  # fmt: skip
    tr.add_argument("--position-weight", type=float,
                    help="weight of the training-only regression of each image token's patch "
                         "column and row (default 0: off)")  # fmt: skip
    tr.add_argument("--object-weight", type=float,
                    help="weight of the training-only regression of the table (x, y) of the "
                         "thing each image token's patch shows (default 0: off)")  # fmt: skip
    tr.add_argument("--bin-sigma", type=float,
                    help="soft targets for the `bins` action ids: a normal this many bins "
                         "wide (HL-Gauss; default 0: one-hot)")  # fmt: skip
    tr.add_argument("--bin-weight", type=float,
                    help="the `bins` action ids' loss weight against other text tokens "
                         "(default 1)")  # fmt: skip
    tr.add_argument("--bin-first", type=float,
                    help="the first step's `bins` ids weigh this many times the others "
                         "(default 1)")  # fmt: skip
    tr.add_argument("--bin-noise", type=float,
                    help="share of the input `bins` ids replaced by random ones, so the "
                         "`ar` decode recovers from its own errors (default 0: off)")  # fmt: skip
    tr.add_argument("--name-weight", type=float,
                    help="weight of the regression of the named things' table (x, y) (the "
                         "instruction's, the questions') from their names' rows (needs "
                         "--ground-weight and --object-weight; default 0: off)")  # fmt: skip
    for flag, kind, text in _DATA_FLAGS:
        tr.add_argument(flag, type=kind, help=text)
    tr.set_defaults(run=run_train)

    ev = commands.add_parser("eval", help="behavioural evaluation (`eval world`), no ROS")
    ev.add_argument("suite", help="world")
    ev.add_argument("args", nargs=argparse.REMAINDER, help="passed to the suite's main")
    ev.set_defaults(run=run_eval)

    probe = commands.add_parser(
        "recall-probe", help="can the backbone learn a two-word-key lookup (train/recall_probe.py)"
    )
    probe.add_argument("args", nargs=argparse.REMAINDER, help="see --help after the command")

    srv = commands.add_parser(
        "serve", help="openpi's websocket policy protocol over this engine (docs/serve.md), no ROS"
    )
    srv.add_argument("args", nargs=argparse.REMAINDER, help="see --help after the command")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # commands whose own flags come first: argparse's REMAINDER would refuse them
    if argv[:1] == ["gpu-check"]:
        from embodied_kv import gpu_check

        return gpu_check.main(argv[1:])
    if argv[:1] == ["recall-probe"]:
        from embodied_kv.train import recall_probe

        return recall_probe.main(argv[1:])
    if argv[:1] == ["serve"]:
        from embodied_kv.serve import main as serve

        return serve.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
