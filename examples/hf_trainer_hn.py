"""Train a transformers CLIPModel with the Hugging Face Trainer and HN-CLIP's loss: the whole change is `HNTrainer`,
five lines of `compute_loss`.

The model here is a tiny CLIPModel built from a config in code and the data are a few random tensors, so the script
runs anywhere in seconds without a download:

    python examples/hf_trainer_hn.py --output-dir runs/hf-hn --steps 20

With a real checkpoint, replace `tiny_clip()` by `CLIPModel.from_pretrained(path)` and `RandomPairs` by your
dataset (items with input_ids, attention_mask and pixel_values). Under several processes (torchrun / accelerate
launch) pass `rank=self.args.process_index, world_size=self.args.world_size` to `hf_hn_loss` so that every rank's
rows meet every rank's captions.
"""

from __future__ import annotations

import argparse

import torch
from transformers import CLIPConfig, CLIPModel, Trainer, TrainingArguments

from sharpclip.losses.drop_in import hf_hn_loss


class HNTrainer(Trainer):
    """transformers.Trainer whose loss is L_HN (HN-CLIP eq. 2) over the batch's CLIPModel embeddings."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        core = getattr(model, "module", model)  # the CLIPModel itself when the Trainer wrapped it (DDP)
        loss = hf_hn_loss(outputs, core.logit_scale, getattr(core, "logit_bias", None), gamma=0.5)
        return (loss, outputs) if return_outputs else loss


def tiny_clip(seed: int = 0) -> CLIPModel:
    """A 1-layer CLIPModel of width 32 on 16×16 images; token ids 0 (pad), 1 (start), 2 (end: HF CLIP pools there)."""
    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    text = {**tower, "vocab_size": 64, "max_position_embeddings": 16, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2}  # fmt: skip
    torch.manual_seed(seed)
    return CLIPModel(CLIPConfig(text_config=text, vision_config={**tower, "image_size": 16, "patch_size": 8}))


class RandomPairs(torch.utils.data.Dataset):
    """n random image-caption pairs: pixel_values (3, 16, 16), input_ids (16,) = start, words, end, padding."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.pixels = torch.randn(n, 3, 16, 16, generator=g)
        lengths = torch.randint(4, 14, (n,), generator=g)
        self.ids = torch.zeros(n, 16, dtype=torch.long)
        for i, length in enumerate(lengths.tolist()):
            self.ids[i, 0], self.ids[i, length + 1] = 1, 2
            self.ids[i, 1 : length + 1] = torch.randint(3, 64, (length,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": (self.ids[i] > 0).long(), "pixel_values": self.pixels[i]}


def main(argv: list[str] | None = None) -> HNTrainer:
    """Train for --steps steps; returns the trainer (its `state.log_history` holds the losses)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/hf-trainer-hn")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = HNTrainer(model=tiny_clip(), args=training, train_dataset=RandomPairs())
    trainer.train()
    return trainer


if __name__ == "__main__":
    losses = [r["loss"] for r in main().state.log_history if "loss" in r]
    print(f"trained {len(losses)} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
