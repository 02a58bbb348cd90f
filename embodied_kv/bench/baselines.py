"""What `bench step` measures the packed step against: each baseline at its best, labelled.

Language, the backbone as transformers' `GemmaForCausalLM` over the VLA's own weights
(`to_hf_gemma(share=True)`), greedy, a fixed number of new tokens:

    hf_eager_one_by_one  `generate` one request at a time, eager attention (the way
                         most robot stacks call it today)
    hf_sdpa_batched      one `generate` over all B prompts, left-padded with an
                         attention mask, sdpa attention (B = 1: the one-request call)
    hf_static_compiled   hf_sdpa_batched with `cache_implementation="static"` and the
                         automatic `torch.compile` of `generate` (CompileConfig defaults:
                         mode "reduce-overhead", as the transformers docs use it, plus
                         dynamic=True as in their example so one compile serves every B);
                         transformers compiles only on accelerators unless
                         `_compile_all_devices` is set, which is done here for the CPU

Action expert, 10 Euler steps over a prefix cache of the same weights:

    lerobot_eager        LeRobot pi05's `sample_actions` (hf_interop.sample_actions_hf_style:
                         the prefix DynamicCache cloned every step, eager attention)
    openpi_compiled      the same loop under `torch.compile(mode="max-autotune")`, openpi's
                         default `pytorch_compile_mode` for its PyTorch pi0.5

A baseline that cannot run here (a compile failure) is reported with its reason, never
dropped. Compile time is measured apart (`compile_s`) and excluded from step times.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList

from embodied_kv.model.hf_interop import sample_actions_hf_style, to_hf_gemma
from embodied_kv.timing import device_clock

EXPERT_COMPILE_MODE = "max-autotune"  # openpi pi0_config.Pi0Config.pytorch_compile_mode
SKIPPED = "skipped: --skip-compiled (compiling takes tens of seconds on a CPU)"


@dataclass
class Generated:
    """One run of B requests: tokens per request, ms per decode step of all B, total ms."""

    tokens: list[list[int]]
    step_ms: float
    total_ms: float


class StepClock(LogitsProcessor):
    """Called once per generated token inside `generate`; records when."""

    def __init__(self, clock: Callable[[], float]):
        self.clock, self.times = clock, []

    def __call__(self, input_ids, scores):
        self.times.append(self.clock())
        return scores

    def median_gap_ms(self) -> float:
        gaps = zip(self.times, self.times[1:], strict=False)
        return statistics.median(1e3 * (b - a) for a, b in gaps)


def left_pad(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [n_i] -> ids [B, L] and attention mask [B, L], padded on the left."""
    width = max(p.shape[0] for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[0] :] = p
        mask[i, width - p.shape[0] :] = 1
    return ids, mask


@dataclass
class HFGenerate:
    """One labelled way of running `generate` over B prompts."""

    name: str
    label: str
    model: torch.nn.Module
    batched: bool
    kwargs: dict = field(default_factory=dict)
    compile_s: float | None = None  # first call's extra time, when it compiles
    unavailable: str | None = None  # why it cannot run here
    cpu_clock: str = "wall"  # timing.CPU_CLOCKS: what a CPU step time is read on

    def _one(self, ids, mask, new_tokens, clock) -> tuple[torch.Tensor, float]:
        stamps = StepClock(clock)
        out = self.model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([stamps]),
            **self.kwargs,
        )
        return out[:, ids.shape[1] :], stamps.median_gap_ms()

    def __call__(self, prompts: list[torch.Tensor], new_tokens: int) -> Generated:
        clock = device_clock(prompts[0].device, self.cpu_clock)
        pad = self.model.generation_config.pad_token_id
        t0 = clock()
        if self.batched:
            out, step_ms = self._one(*left_pad(prompts, pad), new_tokens, clock)
            tokens = out.tolist()
        else:  # B requests advance one token each in B steps
            tokens, step_ms = [], 0.0
            for p in prompts:
                out, ms = self._one(*left_pad([p], pad), new_tokens, clock)
                tokens.append(out[0].tolist())
                step_ms += ms
        return Generated(tokens, step_ms, 1e3 * (clock() - t0))

    def warm(self, prompts: list[torch.Tensor], new_tokens: int) -> None:
        """First calls (compile, allocator); a compile failure marks it unavailable."""
        if self.unavailable is not None:
            return
        compiles = self.kwargs.get("compile_config") is not None
        run = lambda: self(prompts, new_tokens)  # noqa: E731
        extra, self.unavailable = first_calls(run, prompts[0].device, twice=compiles)
        if compiles:
            self.compile_s = extra


def language_baselines(model, compiled: bool = True, cpu_clock: str = "wall") -> list[HFGenerate]:
    """The three language baselines; compiled=False reports the compiled one as skipped;
    their step times on a CPU are read on `cpu_clock` (timing.CPU_CLOCKS)."""
    eager = to_hf_gemma(model, share=True, attn_implementation="eager")
    sdpa = to_hf_gemma(model, share=True, attn_implementation="sdpa")
    static = to_hf_gemma(model, share=True, attn_implementation="sdpa")
    config = CompileConfig(dynamic=True)
    config._compile_all_devices = True  # transformers' own switch for compiling off-GPU
    return [
        HFGenerate(
            "hf_eager_one_by_one",
            "HF generate, eager attention, one request at a time",
            eager,
            batched=False,
            cpu_clock=cpu_clock,
        ),
        HFGenerate(
            "hf_sdpa_batched",
            "HF generate, sdpa, all requests left-padded in one batch",
            sdpa,
            batched=True,
            cpu_clock=cpu_clock,
        ),
        HFGenerate(
            "hf_static_compiled",
            "HF generate, sdpa, static cache + torch.compile (reduce-overhead), batched",
            static,
            batched=True,
            kwargs={"cache_implementation": "static", "compile_config": config},
            unavailable=None if compiled else SKIPPED,
            cpu_clock=cpu_clock,
        ),
    ]


@dataclass
class ExpertBaseline:
    name: str
    label: str
    fn: Callable[[], torch.Tensor]
    compile_s: float | None = None
    unavailable: str | None = None


def expert_baselines(
    expert, cache, prefix_len: int, noise: torch.Tensor, compiled: bool = True
) -> list[ExpertBaseline]:
    """LeRobot's eager loop and openpi's compiled one over the same prefix cache."""
    loop = torch.compile(sample_actions_hf_style, mode=EXPERT_COMPILE_MODE)
    out = [
        ExpertBaseline(
            "lerobot_eager",
            "LeRobot pi05 sample_actions: prefix DynamicCache cloned per step, eager",
            lambda: sample_actions_hf_style(expert, cache, prefix_len, noise),
        ),
        ExpertBaseline(
            "openpi_compiled",
            f"openpi-style: the same sample_actions under torch.compile({EXPERT_COMPILE_MODE})",
            lambda: loop(expert, cache, prefix_len, noise),
        ),
    ]
    if compiled:
        out[1].compile_s, out[1].unavailable = first_calls(out[1].fn, noise.device)
    else:
        out[1].unavailable = SKIPPED
    return out


def first_calls(
    fn: Callable[[], object], device, twice: bool = True
) -> tuple[float | None, str | None]:
    """Call fn twice -> (seconds the first call took beyond the second: compile, None),
    or (None, the reason) when it raises: a baseline that cannot run is reported so.
    twice=False: one warm-up call, (None, None) when it runs."""
    clock = device_clock(device)
    t0 = clock()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - whatever broke is the row's reason
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    first = clock() - t0
    if not twice:
        return None, None
    t1 = clock()
    fn()
    return max(0.0, first - (clock() - t1)), None
