"""Training runs kept in the repository (`runs/<name>/`: the run's `flags` and its
`train_state.safetensors`), continued session after session on whatever machine a session
has: each must still resume with its own flags under the code as it is now, so a change
to the training code that would refuse the saved run (a renamed option, a new default)
fails here, not hours into the next session's call."""

from pathlib import Path

import pytest
from safetensors import safe_open

from embodied_kv.cli import build_parser, train_config
from embodied_kv.train.resume import STATE_FILE, STATE_FORMAT, config_changes

ROOT = Path(__file__).resolve().parents[2]
KEPT = sorted(p for p in (ROOT / "runs").glob("*") if (p / "flags").is_file())


@pytest.mark.parametrize("run", KEPT, ids=[p.name for p in KEPT])
def test_a_kept_run_resumes_with_its_flags(run):
    flags = (run / "flags").read_text().split()
    assert not {"--out", "--resume", "--overwrite", "--init"} & set(flags), flags
    args = build_parser().parse_args(["train", *flags, "--out", str(run), "--resume"])
    cfg = train_config(args)
    with safe_open(str(run / STATE_FILE), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == STATE_FORMAT
    assert config_changes(meta["config"], cfg) == []
    assert 0 < int(meta["step"]) < cfg.steps  # a run still under way (a finished one ships)


# The runs kept now. `world_ramp` left on 2026-11-26 (its flags and log are under
# bench/results/2026-11-26-cpu-intel-xeon-2core/); a run that spans sessions is added here.
KEPT_NAMES: list[str] = []


def test_the_kept_runs_are_found():
    """The glob above sees exactly the runs this repository keeps, and a folder under
    runs/ without a resumable state is not left behind."""
    assert [p.name for p in KEPT] == KEPT_NAMES
    runs = ROOT / "runs"
    folders = runs.glob("*") if runs.is_dir() else []
    strays = sorted(p.name for p in folders if p.is_dir() and p not in KEPT)
    assert strays == [], f"runs/ folders that are not kept runs: {strays}"
