import json

from embodied_kv.bench.capsule import main


def test_capsule_rows_are_token_exact_and_complete(tmp_path):
    out = tmp_path / "capsule.json"
    assert main(["--preset", "tiny", "--quick", "--smoke", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["device"] and r["preset"] == "tiny" and r["token_exact"] is True
    assert r["environment"]["threads"] == 1 and r["environment"]["versions"]["torch"]
    assert [row["prefix_len"] for row in r["rows"]] == [128, 512]
    for row in r["rows"]:
        for key in ("cold", "cold_hf_sdpa", "resident", "restore"):
            s = row[f"{key}_stats"]
            assert 0 < s["p10"] <= row[f"{key}_ms"] == s["median"] <= s["p90"]
        for tier in ("gpu", "host", "disk"):
            assert row[f"snapshot_{tier}_ms"] > 0 and row[f"restore_{tier}_ms"] > 0
        assert row["token_exact"] is True and row["resident_token_exact"] is True
        assert row["bytes"] > 0 and row["speedup"] > 0 and row["speedup_vs_hf_sdpa"] > 0
        assert r["ratios"][f"{row['prefix_len']}/resident_vs_restore"] > 0
    assert (tmp_path / "capsule.png").exists()


def test_a_length_shorter_than_the_frame_prefix_measures_the_prefix(tmp_path):
    """pi05's 3-camera prefix (923 rows) outgrew the arena sized for 128 / 512 rows."""
    from embodied_kv.bench.capsule import bench_prefix, measure
    from embodied_kv.model.config import get_preset
    from embodied_kv.model.hf_interop import to_hf_gemma
    from embodied_kv.model.vla import build_model

    model = build_model(get_preset("tiny", num_cameras=8))  # 8 x 16 image tokens + prompt
    n = bench_prefix(model).embeds.shape[0]
    hf = to_hf_gemma(model, share=True, attn_implementation="sdpa")
    row = measure(model, hf, 16, 1, str(tmp_path))  # was: an arena of 128 rows
    assert n > 128
    assert row["prefix_len"] == n and row["token_exact"] is True
    assert row["resident_token_exact"] is True
