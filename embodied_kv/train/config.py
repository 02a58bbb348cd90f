"""`embodied-kv train`'s settings (`TrainConfig`, validated on construction) and the seed
ranges of training and held-out episodes; the run itself is train/loop.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from embodied_kv.world.dataset import DataConfig

FREEZABLE = ("vision", "backbone", "expert")  # the model's parts (VLA.vision, ...)
TRAIN_SEED_STRIDE = 2**32  # seeds of run `seed` never meet those of another run
EVAL_SEED_BASE = 2**48  # held-out world seeds (eval/world.py) lie above every training seed


@dataclass(frozen=True)
class TrainConfig:
    out: str = "out/train"  # directory: weights.safetensors, tokenizer.json, train_log.jsonl
    preset: str = "world"
    steps: int = 0  # optimiser steps; 0 = until `minutes` runs out
    minutes: float = 0.0  # wall-clock budget; 0 = until `steps`
    batch: int = 32
    buckets: int = 2  # length groups per step (less padding; gradients accumulate)
    lr: float = 2e-3  # AdamW peak, linear warmup then cosine to 10%
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    flow_weight: float = 1.0
    # auxiliary loss: each image token's patch class (world/render.py patch_labels) from
    # a linear head that lives only in training (not in the weights); 0 = off
    patch_weight: float = 1.0
    # the flow loss over the first flow_dims action dims (4: the world's real ones, x y z
    # gripper; dims 4..7 are always 0); 0 = every dim of the model's action_dim
    flow_dims: int = 0
    # the training-only grounding head (train/grounding.py) on the image rows after
    # ground_layer backbone layers: named movable / named container / other; 0 = off
    ground_weight: float = 0.0
    ground_layer: int = 2
    # parts of the model that keep their weights (FREEZABLE). ("vision", "backbone"):
    # knowledge insulation as pi0.5 stops the action expert's gradient at the VLM: the
    # expert learns alone on the flow loss, every text skill stays byte for byte, the
    # training-only heads are off and each step runs the backbone over the prefix only.
    # ("backbone",): the vision tower and the expert learn, the language model does not
    freeze: tuple[str, ...] = ()
    # training-only regression of each image token's patch column and row (in [-1, 1])
    # from the projected image tokens, an extra pair of outputs of the patch head: makes
    # the position a linear part of what the backbone (and the expert through its K/V)
    # reads; 0 = off (train/losses.py position_targets)
    position_weight: float = 0.0
    # training-only regression of the table (x, y) of the thing each image token's patch
    # shows (world/dataset.py object_centres), two more outputs of the patch head: where
    # the named object is, finer than its patch, as a linear part of its tokens; with the
    # grounding head also from its rows (train/grounding.py), what the deeper layers read;
    # 0 = off
    object_weight: float = 0.0
    # the `bins` action ids' targets: a normal this many bins wide integrated over each
    # bin (HL-Gauss, train/action_bins.py) instead of one-hot; 0 = one-hot
    bin_sigma: float = 0.0
    # the `bins` action ids' losses times this against the other text tokens' (an
    # `actions` sample's two informative ids are 1/40 of its mean: train/action_bins.py)
    bin_weight: float = 1.0
    # the first step's `bins` ids (what the observation alone decides) weigh this many
    # times the others (train/action_bins.py first_step_weights); 1 = equal
    bin_first: float = 1.0
    # share of the input `bins` ids replaced by random ones (train/action_bins.py
    # noisy_inputs: the `ar` decode feeds back its own ids, teacher forcing only right
    # ones); 0 = off
    bin_noise: float = 0.0
    # the grounding head's object outputs also regress, from the row of each name the text
    # gives (the instruction's movable and container, a scene question's things), that
    # thing's table (x, y) (train/names.py; needs ground_weight and object_weight > 0);
    # 0 = off
    name_weight: float = 0.0
    seed: int = 0
    log_every: int = 10
    ckpt_every: int = 200
    threads: int = 1
    data_workers: int = 0  # processes making the next steps' samples (0: in this process)
    device: str = "cpu"  # parameters stay fp32 on every device (AdamW master weights)
    # steps of the easy phase: one-hop memory queries over facts that never change (the
    # issue: associative recall sits at chance for long without a curriculum); 0 = none
    curriculum: int = 600
    # steps after the curriculum over which memory updates and the two-hop share grow
    # linearly from 0 to the data config's (0: at once). The lookup is learned on facts
    # that never change (recall-probe --data world, docs/keep_research.md); a run whose
    # streams held up to 24 updates from step 600 on had not learned it at step 12,000.
    ramp: int = 0
    # a weights file of the same preset to start from (fine-tuning, e.g. on longer memory
    # streams); "" = fresh init from cfg.seed. The patch head starts fresh either way.
    init: str = ""
    # std of the fresh text embedding (the engine scales it by sqrt(width)); 0 = the
    # model's own init (0.02, as HF initialises Gemma: 0.23 RMS after the scale, while the
    # first layer's fresh branches add 0.80). The bare two-word-key lookup of
    # `embodied-kv recall-probe` left its plateau in 0 of 4 seeds at 0.02 and in 1 of 4 at
    # width**-0.5 = 0.088 within 1,200 steps (docs/keep_research.md). Ignored with `init` (the
    # file's embedding is kept).
    embed_std: float = 0.0
    # one run in several calls (train/resume.py): `resume` continues the run saved in
    # `out` (train_state.safetensors) with the same config; `until` ends this
    # call before that step, `stop_after` after that many wall-clock minutes; neither
    # changes the learning-rate schedule, which follows `steps` (or `minutes`)
    resume: bool = False
    overwrite: bool = False  # a fresh run may replace the run saved in `out`
    until: int = 0
    stop_after: float = 0.0
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self):
        if self.steps < 0 or self.minutes < 0 or (self.steps == 0 and self.minutes == 0):
            raise ValueError(f"give steps > 0 or minutes > 0 (steps={self.steps}, "
                             f"minutes={self.minutes})")  # fmt: skip
        if self.batch < 1 or self.lr <= 0 or self.log_every < 1 or self.ckpt_every < 1:
            raise ValueError(f"bad train config: {self}")
        if not 1 <= self.buckets <= self.batch:
            raise ValueError(f"buckets={self.buckets} must be in [1, batch={self.batch}]")
        if self.data_workers < 0:
            raise ValueError(f"data_workers={self.data_workers} must be >= 0")
        if self.curriculum < 0 or self.ramp < 0:
            raise ValueError(f"curriculum={self.curriculum} and ramp={self.ramp} steps must "
                             "be >= 0")  # fmt: skip
        if self.init and not Path(self.init).is_file():
            raise ValueError(f"init weights {self.init} do not exist")
        if not 0 <= self.embed_std < 1:
            raise ValueError(f"embed_std={self.embed_std} must be in [0, 1)")
        if self.until < 0 or self.stop_after < 0:
            raise ValueError(f"until={self.until} and stop_after={self.stop_after} must be >= 0")
        if self.name_weight < 0 or (
            self.name_weight > 0 and min(self.ground_weight, self.object_weight) <= 0
        ):
            raise ValueError(f"name_weight={self.name_weight} must be >= 0 and needs the "
                             "grounding head's object outputs (ground_weight, object_weight "
                             "> 0)")  # fmt: skip
        if self.bin_sigma < 0 or self.bin_weight <= 0 or self.bin_first <= 0:
            raise ValueError(f"bin_sigma={self.bin_sigma} must be >= 0, bin_weight="
                             f"{self.bin_weight} and bin_first={self.bin_first} > 0")  # fmt: skip
        if not 0 <= self.bin_noise < 1:
            raise ValueError(f"bin_noise={self.bin_noise} must be in [0, 1)")
        if self.flow_dims < 0 or self.ground_weight < 0 or self.ground_layer < 1:
            raise ValueError(f"flow_dims={self.flow_dims} >= 0, ground_weight="
                             f"{self.ground_weight} >= 0, ground_layer={self.ground_layer} >= 1")
        if not set(self.freeze) <= set(FREEZABLE) or set(self.freeze) == set(FREEZABLE):
            raise ValueError(f"freeze={self.freeze}: some of {FREEZABLE}, not all")
        for name in ("position_weight", "object_weight"):
            w = getattr(self, name)
            if w < 0 or (w > 0 and self.patch_weight <= 0):
                raise ValueError(f"{name}={w} must be >= 0 and needs the patch head "
                                 "(patch_weight > 0)")  # fmt: skip
        if not 0 <= self.seed < 2**15:
            raise ValueError(f"seed {self.seed} must be in [0, 32768)")
