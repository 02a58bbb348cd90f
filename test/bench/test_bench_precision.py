"""`bench precision` end to end on the tiny preset: the bf16 paths against fp32 of the same
weights, the reference chain switched on and off again."""

import json

import torch

from embodied_kv.bench import precision
from embodied_kv.model.config import get_preset
from embodied_kv.model.vla import build_model


def test_bench_precision_json(tmp_path, capsys):
    out = tmp_path / "precision.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--seeds", "2", "--json", str(out)]
    assert precision.main(argv) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 2 * get_preset("tiny").num_cameras
    for r in rows:
        # bf16 differs from fp32, by rounding: far below the chunk's own size
        assert 0 < r["bf16"]["rms"] < 0.1 * r["chunk_rms"]
        assert 0 < r["bf16_ref"]["rms"] < 0.1 * r["chunk_rms"]
    assert set(result["pooled_ratio"]) == {"1", "2"} and result["worst_ratio"] > 0
    assert "VERDICT" in capsys.readouterr().out


def test_reference_chain_is_switched_back():
    model = build_model(get_preset("tiny"), "cpu", torch.bfloat16)
    model.expert.fused_layer_step = True
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    fast = model.vision(images)
    with precision.reference_chain(model):
        assert model.expert.fused_layer_step is False
        assert torch.equal(model.vision(images), model.vision.forward(images, reference=True))
    assert model.expert.fused_layer_step is True and torch.equal(model.vision(images), fast)
    assert "forward" not in vars(model.vision)
