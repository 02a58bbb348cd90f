"""The L2 prefetch kernel (kernels/l2_prefetch.py): the chunks it issues cover every line of
every tensor given, once, and nothing else; under the interpreter in MODE_RECORD (inline
assembly cannot run there), for both GPU modes' chunk sizes; on a GPU the real instructions
run over real weights and change no byte. The sm_90 build of both modes is in
test_offline_compile.py."""

import pytest
import torch

from embodied_kv.kernels import fallback
from embodied_kv.kernels import l2_prefetch as pf

from .conftest import DEVICE, kernel_skip_reason

pytestmark = pytest.mark.skipif(kernel_skip_reason() is not None, reason=str(kernel_skip_reason()))


def tensors(device=DEVICE):
    """Irregular sizes and offsets: views that start mid-line, a 3-byte tensor, an empty one,
    more tensors than one launch takes."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(40_000, generator=g).to(device)
    mat = torch.randn(77, 33, generator=g).to(device, torch.bfloat16)
    return [
        torch.randn(1000, generator=g).to(device),
        mat[5:],  # a view starting 5 x 33 x 2 bytes in: mid-line
        torch.zeros(3, dtype=torch.int8, device=device),
        big[17:30_017],  # an fp32 view off the line
        torch.empty(0, device=device),
        torch.randn(5, generator=g).to(device),
    ]


def lines_of(ts) -> set[int]:
    out = set()
    for t in ts:
        n = t.numel() * t.element_size()
        if n:
            first = t.data_ptr() // pf.LINE * pf.LINE
            out |= set(range(first, t.data_ptr() + n, pf.LINE))
    return out


@pytest.mark.skipif(DEVICE != "cpu", reason="MODE_RECORD runs under the interpreter")
@pytest.mark.parametrize("chunk", [pf.LINE, 1024, pf.BULK_CHUNK])
def test_the_chunks_cover_every_line_of_every_tensor_once(chunk):
    ts = tensors()
    issued = pf.prefetch_kernel(ts, mode=pf.MODE_RECORD, chunk=chunk)
    assert issued.shape[0] == pf.chunks(pf.line_ranges(ts), chunk)
    assert len(pf.line_ranges(ts)) > pf.MAX_RANGES  # two launches
    covered: list[int] = []
    for addr, size in issued.tolist():
        assert addr % pf.LINE == 0 and 0 < size <= chunk and size % pf.LINE == 0
        covered += range(addr, addr + size, pf.LINE)
    assert sorted(covered) == sorted(lines_of(ts))  # every line once, nothing outside


@pytest.mark.skipif(DEVICE != "cpu", reason="MODE_RECORD runs under the interpreter")
def test_a_grid_of_several_programs_strides_without_overlap():
    """More chunks than one program's block: programs stride over the grid."""
    t = torch.zeros(pf.BLOCK * pf.LINE * 5 + 7, dtype=torch.uint8)
    issued = pf.prefetch_kernel([t], mode=pf.MODE_RECORD)
    plan = pf.plan_prefetch(pf.line_ranges([t]), pf.MODE_RECORD, issued)
    assert plan.grid[0] == 6
    assert sorted(a for a, _ in issued.tolist()) == sorted(lines_of([t]))


def test_bad_ranges_are_refused():
    out = torch.empty(1, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="whole 128-byte lines"):
        pf.plan_prefetch([(64, 128)], pf.MODE_LINE, out)
    with pytest.raises(ValueError, match="1 to 4 ranges"):
        pf.plan_prefetch([], pf.MODE_LINE, out)


def test_the_dispatcher_does_nothing_off_cuda():
    """A CPU (or no Triton): nothing issued, nothing changed, and the op stays on."""
    ts = [torch.randn(64)]
    before = ts[0].clone()
    assert pf.prefetch_l2([t.cpu() for t in ts]) is False
    assert pf.prefetch_l2([]) is False
    assert torch.equal(ts[0], before) and "l2_prefetch" not in fallback.OFF


@pytest.mark.skipif(DEVICE != "cuda", reason="the prefetch instructions need a GPU")
def test_on_cuda_the_prefetch_runs_and_changes_nothing():
    ts = [t for t in tensors() if t.numel()]
    before = [t.clone() for t in ts]
    for mode in (pf.MODE_LINE, pf.mode_for(ts[0].device)):
        pf.prefetch_kernel(ts, mode=mode)
    assert pf.prefetch_l2(ts) and "l2_prefetch" not in fallback.OFF
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ts, before, strict=True))
