"""trainer/lightning_callback.py: a Lightning trainer with the supervisor's callback is
judged by the reference trainer's rules: a NaN loss rolls the run back to the Lightning
checkpoint before it, and its checkpoints are recorded as the callback commits them."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from tests.e2e.conftest import command_spec, db_rows, summary_of, tsup

SCRIPT = textwrap.dedent('''
    """A user's Lightning trainer: a linear model, a checkpoint every 10 steps, a NaN loss
    at --nan_at once per run."""
    import argparse, os
    import torch
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from trainer.lightning_callback import SupervisorCallback

    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--nan_at", type=int, default=0)
    ap.add_argument("--ckpt", default=None)
    args = ap.parse_args()
    once = os.path.join(args.ckpt_dir, "..", "nan-once")


    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = ((self.layer(x) - y) ** 2).mean()
            if self.global_step + 1 == args.nan_at and not os.path.exists(once):
                open(once, "w").close()
                loss = loss * float("nan")
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(640, 8, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                               batch_size=16)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            import time
            time.sleep(0.05)


    trainer = L.Trainer(max_steps=40, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[SupervisorCallback(),
                                   ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=10, save_top_k=-1)])
    trainer.fit(Tiny(), ckpt_path=args.ckpt)
''')


def test_a_nan_reported_by_the_lightning_callback_rolls_back_to_its_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "lightning_train.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(script), "--ckpt_dir", "{checkpoint_dir}", "--nan_at", "25"]
    spec = command_spec(tmp_path / "lightning.toml", "lightning", argv, resources={"nodes": 1, "ranks_per_node": 1},
                        resume=["--ckpt={checkpoint}"], checkpoint_layout="lightning", steps=40)
    state = tmp_path / "state"
    s = summary_of(tsup("run", spec, "--state-dir", state, "--json", timeout_s=300))
    assert s["state"] == "SUCCEEDED" and s["attempts"] == 2, s
    [fault] = s["faults"]
    assert fault["kind"] == "nonfinite" and fault["step"] == 25, fault
    [_, second] = s["attempt_history"]
    assert second["resume_step"] == 20 and second["resume_from"].endswith("epoch=0-step=20.ckpt")
    committed = [json.loads(d)["step"] for (d,) in db_rows(state, "SELECT data FROM events WHERE kind = "
                                                                  "'checkpoint.committed' ORDER BY id")]
    assert committed[:2] == [10, 20] and committed[-2:] == [30, 40], committed
