"""A fused op whose Triton kernel cannot be built here runs its torch reference, and says so.

The failures are Triton's own exception classes, raised as Triton raises them at a first
launch (here by the kernel `try_kernel` calls, since this CPU launches no kernel)."""

import logging

import pytest
import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from embodied_kv.kernels import fallback
from embodied_kv.kernels import rope as rope_mod


@pytest.fixture(autouse=True)
def clean_off():
    saved = dict(fallback.OFF)
    fallback.OFF.clear()
    yield
    fallback.OFF.clear()
    fallback.OFF.update(saved)


def test_a_kernel_out_of_resources_runs_the_reference_from_then_on(caplog):
    calls = []

    def kernel():
        calls.append("kernel")
        raise OutOfResources(262144, 232448, "shared memory")  # a tile too big for this GPU

    with caplog.at_level(logging.WARNING):
        assert fallback.try_kernel("op", kernel) is None  # the caller runs its reference
        assert fallback.try_kernel("op", kernel) is None
    assert calls == ["kernel"]  # not tried again
    assert "OutOfResources" in fallback.OFF["op"] and "shared memory" in fallback.OFF["op"]
    assert "the op kernel cannot run here" in caplog.text


def test_a_compile_error_is_taken_too():
    def kernel():
        raise CompilationError("kernel.py", None, "unsupported construct in this Triton")

    assert fallback.try_kernel("op", kernel) is None
    assert fallback.OFF["op"].startswith("CompilationError")


def test_our_own_mistake_still_raises():
    def kernel():
        raise ValueError("wrong shape")

    with pytest.raises(ValueError):
        fallback.try_kernel("op", kernel)
    assert "op" not in fallback.OFF


def test_an_op_off_is_not_tried_and_a_working_kernel_returns_its_result():
    def kernel():
        raise AssertionError("must not run")

    fallback.OFF["other"] = "off"
    assert fallback.try_kernel("other", kernel) is None
    assert fallback.try_kernel("fine", lambda a, b=0: a + b, 2, b=3) == 5


def test_a_dispatcher_with_its_kernel_off_gives_the_references_bytes():
    """rope on the CPU: the reference's bytes through the dispatch; with its kernel off the
    same (the rule: off means the reference)."""
    x, cos, sin = torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    before = rope_mod.rope(x, cos, sin)
    fallback.OFF["rope"] = "off for the test"
    assert torch.equal(rope_mod.rope(x, cos, sin), before)
    assert torch.equal(before, rope_mod.rope_ref(x, cos, sin))


def test_every_dispatcher_goes_through_it():
    """Each `use_kernel(...)` rule in kernels/ guards a `try_kernel` (a bare kernel call
    would crash the robot where Triton cannot build the kernel)."""
    from pathlib import Path

    root = Path(fallback.__file__).parent
    for path in root.glob("*.py"):
        if path.name in ("triton_base.py", "fallback.py"):
            continue
        text = path.read_text()
        assert text.count("use_kernel(") == text.count("try_kernel("), path.name


def test_the_attention_falls_back_to_its_two_launches_not_the_reference(monkeypatch):
    """Where Triton cannot build the expert attention's persistent queue, its two launches
    (the form an H200 measured) run, not the torch reference; the queue is off from then on."""
    from embodied_kv.kernels import expert_attention as attn

    forms = []

    def kernel(*args):
        forms.append(args[8])  # reduce
        if args[8] == "queue":
            raise OutOfResources(262144, 232448, "shared memory")
        return "two launches"

    monkeypatch.setattr(attn, "use_kernel", lambda *t: True)
    monkeypatch.setattr(attn, "expert_attention_kernel", kernel)
    monkeypatch.setattr(attn, "REDUCE", "queue")
    q, kv = torch.zeros(2, 2, 16), torch.zeros(3, 1, 16)
    args = (q, kv, kv, kv[:2], kv[:2], 0.25, torch.zeros(5))
    assert attn.expert_attention(*args) == "two launches"
    assert attn.expert_attention(*args) == "two launches"
    assert forms == ["queue", "launch", "launch"]
    assert "expert_attention_queue" in fallback.OFF and "expert_attention" not in fallback.OFF
