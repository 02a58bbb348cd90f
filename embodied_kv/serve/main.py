"""`embodied-kv serve`: the robot's engine behind openpi's websocket protocol.

    embodied-kv serve [--config YAML] [--preset NAME] [--weights PATH]
                      [--host H] [--port P] [--layout libero|droid|aloha]

Defaults: config/robot.yaml (its `/**` engine parameters, its `serve` section), then
127.0.0.1:8000 and the libero layout. Prints `serving ws://HOST:PORT` once listening
(with --port 0, the port the system gave). Exit 0 after SIGINT / SIGTERM, 2 on a bad
config.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from embodied_kv.config_file import default_config_path, load_params
from embodied_kv.serve.layouts import LAYOUTS


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="embodied-kv serve", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="ROS 2 parameter file (default: config/robot.yaml)")
    p.add_argument("--preset", help="model preset; overrides the config file")
    p.add_argument("--weights", help="weights file or checkpoint dir; overrides the config")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000, openpi's; 0: any free one)")
    p.add_argument("--layout", choices=sorted(LAYOUTS), help="observation keys (default: "
                   "the config's serve.layout, else libero)")  # fmt: skip
    return p.parse_args(list(argv))


def _log(line: str) -> None:
    print(f"embodied-kv serve: {line}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from embodied_kv.engine.startup import start_engine
    from embodied_kv.serve.config import serve_config, serve_engine_config
    from embodied_kv.serve.policy import ServePolicy
    from embodied_kv.serve.server import PolicyServer

    try:
        params = load_params(args.config or default_config_path())
        params = params.with_overrides(preset=args.preset, weights=args.weights)
        cfg = serve_config(params, host=args.host, port=args.port, layout=args.layout)
        engine_cfg = serve_engine_config(params)
        engine = start_engine(engine_cfg, _log)
    except ValueError as e:
        print(f"embodied-kv serve: {e}", file=sys.stderr)
        return 2
    server = PolicyServer(ServePolicy(engine, cfg), cfg, _log)

    def ready(port: int) -> None:
        _log(f"layout {cfg.layout}: {', '.join(server.policy.layout.camera_names(99))}")
        _log(f"serving ws://{cfg.host}:{port}")

    try:
        server.run(ready)
    except OSError as e:  # the port is taken, the address is not ours
        print(f"embodied-kv serve: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
        return 2
    _log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
