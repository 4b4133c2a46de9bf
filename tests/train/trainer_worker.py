"""Runs a tiny training (optionally under torchrun, optionally resuming) and writes the final weights.

python trainer_worker.py RUN_DIR OUT.safetensors [resume] [dropout] [probe] [key=value ...]   (train config overrides)

probe: OUT also holds `probe/rank<R>`, each rank's next torch.rand(4) after training.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.config import LossConfig, ModelConfig, TermConfig, TrainConfig
from sharpclip.models.factory import save_checkpoint
from sharpclip.train import checkpoint, distributed
from sharpclip.train.features import build_objective
from sharpclip.train.trainer import Trainer


def main(run_dir: str, out: str, args: list[str]) -> None:
    distributed.init_from_env(torch.device("cpu"))
    resume = "resume" in args
    dropout = 0.1 if "dropout" in args else 0.0
    overrides = [a for a in args if "=" in a]
    base = OmegaConf.structured(train_config(run_dir))
    cfg = OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.from_dotlist(overrides)))
    assert isinstance(cfg, TrainConfig)
    model = toy_model(attention_dropout=dropout)
    world = distributed.world_size()
    loader = ToyLoader(model.tokenizer, batch_size=cfg.batch_size, rank=distributed.rank(), world=world)
    terms = {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip", weight=0.5)}
    objective = build_objective(LossConfig(terms=terms))

    def write_model(directory: Path, state: dict | None = None) -> None:
        save_checkpoint(model, directory, ModelConfig(name="tiny-clip"), state=state)

    trainer = Trainer(model, objective, loader, cfg, Path(run_dir), write_model=write_model)
    if resume:
        trainer.resume(checkpoint.latest(Path(run_dir) / "checkpoints"))
    trainer.fit()
    whole = trainer.engine.full_model_state() if trainer.engine is not None else model.state_dict()  # every rank
    weights = {k: v.contiguous() for k, v in whole.items()}
    if "probe" in args:  # each rank's next random draw after training: equal only if the ranks share one stream
        weights |= {f"probe/rank{r}": p for r, p in enumerate(distributed.all_ranks(torch.rand(4)))}
    if distributed.rank() == 0:
        save_file(weights, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
