"""trainer/client.py: a trainer the supervisor did not write, with a few calls of the
client (and no torch), is judged by the same rules as the reference trainer: a NaN in
its loss rolls the run back to the checkpoint before it. Outside a run, the calls do
nothing."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tests.e2e.conftest import command_spec, summary_of, tsup
from trainer.client import Reporter

SCRIPT = textwrap.dedent('''
    """A user's trainer: its state is its step; its loss turns NaN once, at --nan_at."""
    import argparse, json, os, time
    from trainer.client import Reporter

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--nan_at", type=int, default=0)
    ap.add_argument("--resume_from_checkpoint", default=None)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    tsup = Reporter()
    tsup.phase("init")
    start = 0
    if args.resume_from_checkpoint:
        with open(os.path.join(args.resume_from_checkpoint, "state.json")) as f:
            start = json.load(f)["step"]
        tsup.resumed(start)
    once = os.path.join(args.save_dir, "..", "nan-once")
    for step in range(start + 1, args.steps + 1):
        time.sleep(0.1)
        loss = 2.0 / step
        if step == args.nan_at and not os.path.exists(once):
            loss = float("nan")
            open(once, "a").close()  # by whichever rank gets there first: the next attempt's do not
        tsup.step(step, loss=loss, lr=0.1)  # no grad norm measured: none is judged
        if step % 10 == 0 and rank == 0:
            d = os.path.join(args.save_dir, f"llama_v3-{step}steps")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"step": step}, f)
            with open(os.path.join(d, ".metadata"), "w") as f:  # last: the save is complete
                f.write("metadata")
            tsup.checkpoint(step, d)
    tsup.close()
''')


def test_a_nan_reported_through_the_client_rolls_the_run_back(tmp_path: Path) -> None:
    script = tmp_path / "user_train.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(script), "--steps", "40", "--save_dir", "{checkpoint_dir}", "--nan_at", "25"]
    spec = command_spec(tmp_path / "client.toml", "client", argv, resources={"nodes": 1, "ranks_per_node": 2},
                        resume=["--resume_from_checkpoint={checkpoint}"], checkpoint_layout="dcp", steps=40)
    s = summary_of(tsup("run", spec, "--state-dir", tmp_path / "state", "--json", timeout_s=180))
    assert s["state"] == "SUCCEEDED" and s["attempts"] == 2, (s["faults"], s["attempt_history"])
    [fault] = s["faults"]
    assert fault["kind"] == "nonfinite" and "step 25" in fault["summary"], fault
    assert s["attempt_history"][1]["resume_step"] == 20, "the newest checkpoint before the NaN"
    assert s["final_step"] == 40


def test_outside_a_supervised_run_the_client_does_nothing() -> None:
    tsup = Reporter({})
    assert not tsup.enabled
    tsup.phase("compile")
    tsup.step(1, loss=float("nan"))
    tsup.checkpoint(1, "/nowhere")
    tsup.close()
    with pytest.raises(ValueError, match="'warmup' is not a valid Phase"):
        tsup.phase("warmup")
