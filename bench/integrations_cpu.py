"""memfit in Hugging Face's Trainer and in Lightning, on this CPU: a config-built GPT-2 (2 layers
x 64, vocabulary 256, 32 tokens) trains a few steps with a plan that steps the optimizer in
backward and chunks the loss; each integration logs memfit's predicted peak and the measured one.
Prints both, and the error, for every logged step.

    .venv/bin/python -m bench.integrations_cpu [--steps 4] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import csv
import platform
import tempfile

import torch

PLAN = {"optimizer_in_backward": True, "loss_chunks": 4}
CONFIG = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)
PREDICTED, MEASURED = "memfit/predicted_peak_bytes", "memfit/measured_peak_bytes"


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, CONFIG["vocab_size"], (64, CONFIG["n_positions"]),
                                 generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(1)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def hugging_face(steps: int, batch: int, out: str) -> list[tuple[int, float, float]]:
    from transformers import TrainingArguments

    from memfit.integrations.transformers import MemfitTrainer
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", max_grad_norm=0.0, disable_tqdm=True)
    trainer = MemfitTrainer(model=gpt2(), args=args, train_dataset=Tokens(), plan=PLAN)
    trainer.train()
    return [(h["step"], h[PREDICTED], h[MEASURED]) for h in trainer.state.log_history if MEASURED in h]


def lightning(steps: int, batch: int, out: str) -> list[tuple[int, float, float]]:
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger

    from memfit.integrations.lightning import MemfitCallback, MemfitModule

    class LitGPT(MemfitModule, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gpt2()

    logger = CSVLogger(out, name="bench")
    trainer = L.Trainer(max_steps=steps, max_epochs=1, accelerator="cpu", logger=logger, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[MemfitCallback(plan=PLAN)])
    trainer.fit(LitGPT(), torch.utils.data.DataLoader(Tokens(), batch_size=batch))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get(MEASURED)]
    return [(int(r["step"]), float(r[PREDICTED]), float(r[MEASURED])) for r in rows[:1]]  # (logged once)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    a = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, CPU; plan {PLAN}")
    print(f"{'integration':<14} {'step':>4} {'predicted B':>12} {'measured B':>12} {'error':>8}")
    for name, run in (("transformers", hugging_face), ("lightning", lightning)):
        with tempfile.TemporaryDirectory() as out:
            for step, predicted, measured in run(a.steps, a.batch_size, out):
                print(f"{name:<14} {step:>4} {predicted:>12,.0f} {measured:>12,.0f} "
                      f"{100 * (measured - predicted) / predicted:>+7.2f}%")


if __name__ == "__main__":
    main()
