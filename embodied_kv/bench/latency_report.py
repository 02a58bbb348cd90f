"""`bench latency`'s printed report: the rows, the verdict against the arithmetic limit, and a
LOSS line wherever the product's path loses (to eager, to the other layer-step, to the tree
without an untimed change, to LeRobot)."""

from __future__ import annotations

from embodied_kv.bench import kernel_profile, latency_breakdown
from embodied_kv.bench.report import print_table

UNTIMED = (("prev", "the untimed changes"), ("unsplit", "the key splits"),
           ("noprefetch", "the weight prefetch"))  # fmt: skip


def report(result: dict) -> None:
    rows = result["rows"]
    print_table(
        "cams prefix graphs_ms p90 eager_ms eager/graphs limit_ms graphs/limit limit48_ms "
        "graphs/limit48".split(),
        [
            [
                r["cameras"], r["prefix_len"], r["graphs_ms"]["median"], r["graphs_ms"]["p90"],
                r["eager_ms"]["median"], r["eager_over_graphs"], r["limit_ms"] or "-",
                "-" if r["graphs_over_limit"] is None else f"{r['graphs_over_limit']:.2f}x",
                r["limit_48_text_ms"] or "-",
                "-" if r["graphs_over_limit_48_text"] is None
                else f"{r['graphs_over_limit_48_text']:.2f}x",
            ]
            for r in rows
        ],
    )  # fmt: skip
    for r in rows:
        if result["graph_mode"] == "emulate":  # no CUDA graph exists on a CPU
            print(f"{r['cameras']} cameras: graphs in CPU emulation (the code path, not a "
                  "speed: on a CPU the engine runs eager)")
        elif r["eager_over_graphs"] < 1:
            print(f"LOSS: {r['cameras']} cameras: eager is {1 / r['eager_over_graphs']:.2f}x "
                  f"faster than the graph path")  # fmt: skip
    judged = [r for r in rows if r["graphs_over_limit"] is not None]
    if judged:
        worst = max(r["graphs_over_limit"] for r in judged)
        verdict = "PASS" if worst <= result["goal_x_limit"] else "FAIL"
        print(f"VERDICT {verdict}: action latency with graphs is "
              + ", ".join(f"{r['graphs_ms']['median']:.2f} ms = {r['graphs_over_limit']:.2f}x "
                          f"the limit of its {r['prefix_len']} prefix rows "
                          f"({r['limit_ms']:.2f} ms; {r['graphs_over_limit_48_text']:.2f}x the "
                          f"48-text-token limit) at {r['cameras']} cameras" for r in judged)
              + f" (goal <= {result['goal_x_limit']}x)")  # fmt: skip
    for r in rows:
        if "graphs_unfused_ms" in r:
            ratio, own = r["unfused_over_fused"], r["layer_step"]
            lost = (ratio < 1) == (own == "fused") and result["graph_mode"] != "emulate"
            print(f"{r['cameras']} cameras: the expert's layer-step unfused (the chain) "
                  f"{r['graphs_unfused_ms']['median']:.2f} ms, fused (persistent launches) "
                  f"{r['graphs_fused_ms']['median']:.2f} ms: unfused = {ratio:.2f}x fused; the "
                  f"product runs {own}" + ("  LOSS: the other layer-step is faster here"
                                           if lost else ""))  # fmt: skip
        for name, what in UNTIMED:
            if f"graphs_{name}_ms" not in r:
                continue
            ratio = r[f"{name}_over_graphs"]
            lost = ratio < 1 and result["graph_mode"] != "emulate"
            print(f"{r['cameras']} cameras: without {what} (graphs_{name}) "
                  f"{r[f'graphs_{name}_ms']['median']:.2f} ms = {ratio:.2f}x the product's path"
                  + (f"  LOSS: {what} are slower here" if lost else ""))  # fmt: skip
        if "graphs_frames_ms" in r:
            h, w = r["frames_hw"]
            print(f"{r['cameras']} cameras: camera frames ({h}x{w} uint8, converted on the "
                  f"device in the cycle) {r['graphs_frames_ms']['median']:.2f} ms = "
                  f"{r['frames_over_graphs']:.2f}x the graphs path fed converted images")
        if "rtc" in r:
            print(f"{r['cameras']} cameras: RTC ({r['rtc']}) from its graph "
                  f"{r['graphs_rtc_ms']['median']:.2f} ms = {r['rtc_over_graphs']:.2f}x the "
                  "plain graphs path")  # fmt: skip
    for op, why in result.get("kernels_off", {}).items():
        print(f"LOSS: the {op} kernel could not be built here ({why}): its torch reference ran")
    if result.get("queue_timeouts"):
        print(f"ERROR: {result['queue_timeouts']} persistent launches had a wait time out "
              "(kernels/work_queue.py): their outputs are wrong")  # fmt: skip
    report_peer(result)
    latency_breakdown.report(rows)
    kernel_profile.report(rows)


def report_peer(result: dict) -> None:
    """LeRobot's rows (bench/lerobot_peer.py), and LOSS where it is faster than our path;
    a LeRobot that failed part-way keeps the rows it measured before."""
    peer = result.get("peer")
    if not peer:
        return
    if peer["unavailable"]:
        print(f"peer LeRobot {peer['pinned']}: not measured: {peer['unavailable']}")
    for r in result["rows"]:
        for name in ("lerobot", "lerobot_compiled"):
            if f"{name}_ms" not in r:
                continue
            ratio = r[f"{name}_over_ours"]
            what = "eager" if name == "lerobot" else (
                f"torch.compile {peer['compile_mode']}, fp32 matmul precision "
                f"'{peer.get('compiled_matmul_precision')}'")
            print(f"{r['cameras']} cameras: LeRobot {peer['pinned']} PI05Policy ({what}, "
                  f"{r['lerobot_prefix_rows']} prefix rows) {r[f'{name}_ms']['median']:.2f} ms = "
                  f"{ratio:.2f}x our {peer['ours']} path"
                  + ("  LOSS: LeRobot is faster" if ratio < 1 else ""))  # fmt: skip
        if "lerobot_vs_ours" in r:
            a = r["lerobot_vs_ours"]
            print(f"{r['cameras']} cameras: LeRobot's chunk vs ours, same weights and noise: max "
                  f"|diff| {a['max_abs_diff']:.3g} (our chunk's rms {a['chunk_rms']:.3g})")
