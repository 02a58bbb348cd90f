"""The tables `python -m embodied_kv.bench.estimate_h200` prints and writes: the fitted
regions (measured against estimated, per commit, layer-step and camera count) and this
tree's prediction on the H200's constants, at the H100's bandwidth and on the older H100
calibration."""

from __future__ import annotations

import json

from embodied_kv.bench import estimate_calibration as cal
from embodied_kv.bench import estimate_h200 as h2


def fitted_rows(estimated: dict) -> list[dict]:
    """Per (commit, layer-step, cameras, region of FIT_ON, host, total): measured, estimate,
    error. The chain's denoise and total are by difference (`targets`); its vision and
    prefill the fused path's (the same kernels); host is measured (embed + host), not priced."""
    rows = []
    for (commit, path), names in h2.FIT_ON.items():
        shown = [r for r in h2.REGIONS if r in names] + ["host", "total"]
        for cams, meas in h2.targets(commit, path).items():
            est = estimated[(commit, path)][h2.key(cams)]
            for g in shown:
                m = h2.host_ms(commit)[cams] if g == "host" else meas[g]
                rows.append(
                    dict(commit=commit, layer_step=path, cameras=cams, region=g,
                         measured_ms=m, estimate_ms=est[g], error_pct=100 * (est[g] / m - 1))
                )  # fmt: skip
    return rows


def as_h100_calibration(census: dict) -> dict:
    """The census with the two classes split off here put back (estimate_calibration's)."""
    back = {"triton_gemm": "gemm", "expert_fused": "expert"}
    text = json.dumps(census)
    for new, old in back.items():
        text = text.replace(f'"cls": "{new}"', f'"cls": "{old}"')
    return json.loads(text)


def today_rows(censuses: dict) -> list[dict]:
    """Per (layer-step, cameras): this tree's regions on the H200 constants, its totals on
    them, on the same constants at the H100's bandwidth, and on estimate_calibration's
    H100 constants; each with the latest measured host term (`host_ms()`)."""
    host = h2.host_ms()
    rows = []
    for path, census in censuses.items():
        h200, h100 = h2.price(census, host), h2.price(census, host, h2.params(h2.HBM_H100))
        old = cal.price(as_h100_calibration(census), logits=False)
        for k, r in h200.items():
            cams = int(k.split("/")[0])
            rows.append(
                dict(layer_step=path, cameras=cams, **{f"{g}_ms": r[g] for g in r},
                     h100_total_ms=h100[k]["total"],
                     h100_calibration_total_ms=sum(old[k][g] for g in h2.REGIONS) + host[cams])
            )  # fmt: skip
    return rows


def print_tables(fitted: list[dict], today: list[dict], worst_err: float) -> None:
    print("H200, measured against estimated (ms)")
    print("commit   step   cams region   measured  estimate   err%")
    for r in fitted:
        print(
            f"{r['commit']:<8} {r['layer_step']:<6} {r['cameras']:>4} {r['region']:<8} "
            f"{r['measured_ms']:>8.2f} {r['estimate_ms']:>9.2f} {r['error_pct']:>6.1f}"
        )
    print(f"worst error over the fitted regions: {100 * worst_err:.1f} %")
    print("\nthis tree, predicted (ms; the measured prefixes, host term of 408d8ee)")
    print("step   cams  vision  prefill  denoise  host  H200 total  H100 total  H100 (11-26)")
    for r in today:
        print(
            f"{r['layer_step']:<6} {r['cameras']:>4} {r['vision_ms']:>7.2f} "
            f"{r['prefill_ms']:>8.2f} {r['denoise_ms']:>8.2f} {r['host_ms']:>5.2f} "
            f"{r['total_ms']:>11.2f} {r['h100_total_ms']:>11.2f} "
            f"{r['h100_calibration_total_ms']:>13.2f}"
        )
