"""The CPU step padding (kernels/packed_attention.py ROW_BUCKET): probed per process, because
fp32 GEMMs of few rows round differently per CPU (1..3 rows here, 1..15 on an Intel Xeon with
MKL), or given with EMBODIED_KV_ROW_BUCKET."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from embodied_kv.kernels.packed_attention import ROW_BUCKET, ROW_BUCKETS, probe_row_bucket

ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_is_stable_and_its_bucket_is_row_invariant():
    given = os.environ.get("EMBODIED_KV_ROW_BUCKET")
    assert probe_row_bucket() == probe_row_bucket()  # deterministic per CPU
    assert ROW_BUCKET == (int(given) if given else probe_row_bucket())
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 80, generator=g), torch.randn(64, 80, generator=g)  # another shape
    ref = F.linear(x, w)
    for m in range(ROW_BUCKET, 64, ROW_BUCKET):
        assert torch.equal(F.linear(x[:m], w), ref[:m]), m


def run_with_bucket(value: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, EMBODIED_KV_ROW_BUCKET=value, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_larger_bucket_keeps_packed_steps_byte_exact():
    """What a CPU like the Intel host gets (16): batched decode = one by one, chunked
    prefill = at once, a mixed step = separate steps, all in bytes."""
    proc = run_with_bucket(
        "16", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test/model/test_packed_exactness.py",
        "-k", "batched_decode or chunked_prefill or mixed_step",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    check = "from embodied_kv.kernels.packed_attention import ROW_BUCKET; print(ROW_BUCKET)"
    assert run_with_bucket("16", "-c", check).stdout.strip() == "16"


def test_a_bad_bucket_is_refused_with_the_choices():
    proc = run_with_bucket("5", "-c", "import embodied_kv.kernels.packed_attention")
    assert proc.returncode != 0 and "EMBODIED_KV_ROW_BUCKET='5'" in proc.stderr
    assert str(ROW_BUCKETS) in proc.stderr


def test_cuda_arenas_pad_to_their_own_bucket_whatever_the_host_probes():
    """The H100 host's Xeon probes 32; a CUDA arena's steps and LM head still use 8 rows
    (CUDA_ROW_BUCKET), a CPU arena's the probe's 32."""
    check = (
        "from types import SimpleNamespace as N; import torch\n"
        "from embodied_kv.kernels.packed_attention import row_bucket, CUDA_ROW_BUCKET\n"
        "from embodied_kv.storage.step import logit_rows\n"
        "arena = lambda d: N(device=torch.device(d), spec=N(num_slots=5))\n"
        "print(row_bucket('cpu'), row_bucket('cuda'), row_bucket(torch.device('cuda', 0)),\n"
        "      logit_rows(arena('cpu')), logit_rows(arena('cuda')), CUDA_ROW_BUCKET)\n"
    )
    proc = run_with_bucket("32", "-c", check)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["32", "8", "8", "32", "8", "8"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA arena needs a GPU")
def test_a_cuda_decode_is_padded_to_the_cuda_bucket():
    from embodied_kv.kernels.packed_attention import CUDA_ROW_BUCKET
    from embodied_kv.model.config import get_preset
    from embodied_kv.model.vla import build_model
    from embodied_kv.storage.step import Segment, logit_rows, plan_step

    m = build_model(get_preset("tiny"), "cuda")
    arena = m.new_arena(4, 256)
    slot = arena.allocate()
    assert plan_step(arena, [Segment(slot, 1, True)]).n_padded == CUDA_ROW_BUCKET
    assert logit_rows(arena) == CUDA_ROW_BUCKET
