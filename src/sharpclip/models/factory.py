"""Build a `DualEncoder` from a `ModelConfig`, and save / reload sharpclip checkpoints. Never touches the network.

`model.name` may be
- a tiny preset: `tiny-clip`, `tiny-siglip`, `tiny-siglip2` (random weights; tests and the demo);
- a sharpclip checkpoint folder (layout below), e.g. the output of `sharpclip distill` or a training run's checkpoint;
- a training run's directory (`RUN`, with `checkpoints/` inside): its newest complete checkpoint, as `eval --model
  RUN` takes (the log names it, and the one `best.json` names when that differs);
- a transformers folder (`config.json` + weights: CLIP, SigLIP, SigLIP 2), or a hub id already in the local HF cache;
- an open_clip folder (`open_clip_config.json` + weights, as the hub holds them), converted to CLIPModel with the
  activation, heads and preprocessing its config names (models.open_clip);
- an OpenAI-format state dict file (`.pt` / `.pth` / `.bin` / `.safetensors`, e.g. Long-CLIP's `longclip-L.pt`);
  its tokenizer and image processor come from `model.processor` (e.g. `openai/clip-vit-large-patch14`); with no
  config beside it, QuickGELU is assumed unless `model.activation` says otherwise (a warning says so);
- an open_clip checkpoint file without a config (open_clip_train's `epoch_N.pt`) with `model.open_clip_config`
  naming its architecture; such a training checkpoint without that setting is refused (heads cannot be read from
  tensors).

Then, in order: the Long-CLIP stretch (`model.context_length`), the RoPE text tower (`model.text_encoder=rope`),
adapters (`model.adapter`), the logit scale settings and freezing (`model.freeze`). Each structural step is
idempotent, so loading a checkpoint that already has it changes nothing.

Checkpoint layout (written by `save_checkpoint`, read by `load_checkpoint`; the trainer writes one per save, e.g.
`RUN/checkpoints/step-000100/`, beside its training state; see train.checkpoint):

    config.json            the transformers config of the backbone, including what sharpclip changed: stretched
                           `max_position_embeddings`, `sharpclip_keep_positions`, `sharpclip_rope`
    sharpclip_model.yaml   the ModelConfig that built the model (adapters are rebuilt from it)
    model.safetensors      `DualEncoder.state_dict()` (adapters unmerged, frozen position rows included)
    tokenizer files, preprocessor_config.json   (when the model has them)
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoTokenizer,
    CLIPModel,
    PretrainedConfig,
    PreTrainedModel,
    Siglip2Model,
    SiglipModel,
)

from sharpclip.config import ModelConfig
from sharpclip.data.synthdense.captions import vocabulary as synthdense_vocabulary
from sharpclip.models import adapters, freezing, long_context, open_clip, rope
from sharpclip.models.hf import HFDualEncoder, wrap
from sharpclip.models.openai_format import clip_from_openai, read_checkpoint
from sharpclip.models.tiny import TINY_WORDS, tiny_model

log = logging.getLogger("sharpclip.models")
CHECKPOINT_CONFIG = "sharpclip_model.yaml"
WEIGHTS = "model.safetensors"
MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {"clip": CLIPModel, "siglip": SiglipModel, "siglip2": Siglip2Model}
OPENAI_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
RUN_CHECKPOINTS, RUN_BEST, RUN_DIVERGED = "checkpoints", "best.json", "diverged.json"  # train.checkpoint's layout
RUN_MARKER = ".sharpclip-run"  # train.run_dir.MARKER: a run directory, even one with no checkpoint yet


def step_order(path: Path) -> tuple[int, str]:
    """The sort key of checkpoint folders, oldest first: names are padded to 6 digits only, so step-1000000 sorts
    after step-999999 by its length first."""
    return len(path.name), path.name


class ModelNotFoundError(FileNotFoundError):
    """`model.name` is not a preset, not on disk and not in the local HF cache."""


def create_model(cfg: ModelConfig) -> HFDualEncoder:
    """The dual encoder `cfg` describes, ready to train (see the module docstring for what `cfg.name` may be)."""
    model = _load_base(cfg)
    apply_structure(model, cfg)
    apply_training_setup(model, cfg)
    return model


def _load_base(cfg: ModelConfig) -> HFDualEncoder:
    if cfg.name.startswith("tiny-"):
        return tiny_model(cfg.name.removeprefix("tiny-"), tiny_words(cfg.vocabulary), size=cfg.tiny)
    path = Path(cfg.name).expanduser()
    if (path / CHECKPOINT_CONFIG).is_file():
        return load_checkpoint(path)
    is_run = (path / RUN_CHECKPOINTS).is_dir() or (path / RUN_MARKER).is_file()  # a run before its first checkpoint too
    if is_run and not (path / "config.json").is_file():
        return load_checkpoint(run_checkpoint(path, cfg.name))
    if open_clip.is_open_clip_folder(path) and (cfg.kind == "open_clip" or not (path / "config.json").is_file()):
        if cfg.open_clip_config:
            raise ValueError(f"{path}: the folder has its own {open_clip.CONFIG}; unset model.open_clip_config "
                             "(it is for a bare checkpoint file)")  # fmt: skip
        return _from_open_clip(path, cfg)
    if cfg.kind == "open_clip":
        raise ModelNotFoundError(f"model.kind=open_clip but {path} holds no {open_clip.CONFIG}")
    if path.is_file() and path.suffix in OPENAI_SUFFIXES:
        return _from_openai(path, cfg)
    if not path.exists() and is_local_path(cfg.name):
        raise ModelNotFoundError(_no_local(cfg.name, path))
    return _from_transformers(cfg)


def run_checkpoint(run: Path, name: str = "") -> Path:
    """The newest complete checkpoint of run directory `run` (a `checkpoints/step-N` folder holding the model files,
    none marked diverged), logged with the one `best.json` names when that differs; a run with none is a
    `ModelNotFoundError` saying what to give instead."""
    name = name or str(run)
    found = sorted((p for p in (run / RUN_CHECKPOINTS).glob("step-*") if _complete_checkpoint(p)), key=step_order)
    if not found:
        raise ModelNotFoundError(
            f"model.name={name!r}: a run directory without a complete checkpoint in {run / RUN_CHECKPOINTS} (a "
            "checkpoints/step-N folder with sharpclip_model.yaml and model.safetensors); let the run save one, or "
            "give a model folder"
        )
    best = ""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        best = json.loads((run / RUN_CHECKPOINTS / RUN_BEST).read_text())["name"]
    other = f"; best.json names {best}: model.name={run / RUN_CHECKPOINTS / best} for that one" * (
        bool(best) and best != found[-1].name
    )
    log.info("model.name=%s: a run directory; using its newest complete checkpoint %s%s", name, found[-1].name, other)
    return found[-1]


def _complete_checkpoint(folder: Path) -> bool:
    model_files = (folder / CHECKPOINT_CONFIG).is_file() and (folder / WEIGHTS).is_file()
    return folder.is_dir() and not folder.is_symlink() and model_files and not (folder / RUN_DIVERGED).exists()


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # `name` or `org/name`, as the Hugging Face hub


def is_local_path(name: str) -> bool:
    """Whether `model.name` can only mean a local file or folder: it starts with `.`, `/` or `~`, holds a backslash
    or more than one `/` (no hub id does), or its first part is a folder here (`runs/x` when ./runs exists). Else
    (`openai/clip-vit-base-patch32`, a bare name) it may be a hub id in the HF cache."""
    if name.startswith((".", "/", "~")) or not HUB_ID.fullmatch(name):
        return True
    head, sep, _ = name.partition("/")
    return bool(sep) and Path(head).is_dir()


def _no_local(name: str, path: Path) -> str:
    """'no such file or folder', with the closest entries of its folder or the nearest folder that exists."""
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    close = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir()], n=3)
    if parent == path.parent and close:
        hint = f"did you mean {' or '.join(str(parent / c) for c in close)}?"
    else:
        hint = f"the nearest folder that exists is {parent}"
    return f"model.name={name!r}: no such file or folder (a local path, not a hub id); {hint}"


def tiny_words(vocabulary: str) -> tuple[str, ...]:
    """The word list of a tiny preset's tokenizer: built in, SynthDense's, or one word per line of a file."""
    if not vocabulary:
        return TINY_WORDS
    if vocabulary == "synthdense":
        return tuple(synthdense_vocabulary())
    path = Path(vocabulary).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model.vocabulary={vocabulary!r}: not 'synthdense' and no such file (one word a line)")
    return tuple(w for w in path.read_text().split() if w)


def _from_openai(path: Path, cfg: ModelConfig) -> HFDualEncoder:
    state, meta = read_checkpoint(path)
    if cfg.open_clip_config:
        return _from_open_clip_file(path, state, cfg)
    if meta.get("training_checkpoint"):
        raise ValueError(_needs_open_clip_config(path, meta))
    activation = cfg.activation or "quick_gelu"
    backbone = clip_from_openai(state, activation=activation, source=str(path))
    tokenizer, processor = _processors(cfg.processor) if cfg.processor else (None, None)
    log.warning(
        "%s: a bare state dict, no %s beside it: assumed the %s activation%s, attention heads = width / 64 and "
        "%s. For an open_clip model set model.open_clip_config=<its architecture, e.g. ViT-B-32> instead; "
        "else override with model.activation=gelu|quick_gelu and model.processor=<folder with the image processor>",
        path, open_clip.CONFIG, activation, "" if cfg.activation else " (OpenAI's)",
        f"the preprocessing of {cfg.processor}" if processor is not None else "CLIP's preprocessing at the "
        "weights' image size (bicubic, centre crop, OpenAI mean/std)",
    )  # fmt: skip
    if tokenizer is not None:
        tokenizer.model_max_length = backbone.config.text_config.max_position_embeddings
    return wrap(backbone, tokenizer, processor)


def _needs_open_clip_config(path: Path, meta: dict[str, Any]) -> str:
    """The refusal of an open_clip_train checkpoint loaded without its architecture."""
    arch = open_clip.run_name_architecture(str(meta.get("name", "")))
    said = f"; its run name says --model {arch}" if arch else ""
    example = arch or "ViT-B-32"
    return (
        f"{path}: an open_clip training checkpoint (epoch {meta.get('epoch', '?')}) holds no model config, and the "
        f"attention heads cannot be read from its tensors{said}. Set model.open_clip_config={example} (the --model it "
        "was trained with; shipped: " + ", ".join(open_clip.bundled_configs()) + ") or the path of its model JSON"
    )


def _from_open_clip_file(path: Path, state: dict[str, torch.Tensor], cfg: ModelConfig) -> HFDualEncoder:
    """A bare open_clip checkpoint file with the architecture `model.open_clip_config` names."""
    if cfg.activation:
        raise ValueError("model.activation and model.open_clip_config both set the activation; drop model.activation "
                         "(the open_clip config's quick_gelu decides)")  # fmt: skip
    backbone, image_processor, activation = open_clip.clip_from_open_clip_file(path, state, cfg.open_clip_config)
    return _open_clip_model(path, backbone, image_processor, activation, cfg, cfg.processor)


def _from_open_clip(path: Path, cfg: ModelConfig) -> HFDualEncoder:
    """An open_clip folder converted to CLIPModel; tokenizer from model.processor, else the folder's own files."""
    backbone, image_processor, activation = open_clip.clip_from_open_clip(path)
    return _open_clip_model(path, backbone, image_processor, activation, cfg, cfg.processor or str(path))


def _open_clip_model(
    path: Path, backbone: CLIPModel, image_processor: Any, activation: str, cfg: ModelConfig, source: str
) -> HFDualEncoder:
    """Wrap a converted open_clip model with its tokenizer (from `source`) and the config's image processor."""
    tokenizer, processor = _processors(source) if source else (None, None)
    if tokenizer is not None:
        tokenizer.model_max_length = backbone.config.text_config.max_position_embeddings
    else:
        log.warning("%s: no tokenizer files; set model.processor to a CLIP tokenizer folder before training", path)
    log.info("%s: open_clip model converted to CLIPModel (activation %s)", path, activation)
    chosen = processor if cfg.processor and processor is not None else image_processor  # the config's, unless asked
    return wrap(backbone, tokenizer, chosen)


def _from_transformers(cfg: ModelConfig) -> HFDualEncoder:
    """A transformers folder or cached hub id, with `local_files_only` (an error says what to download)."""
    try:
        config = AutoConfig.from_pretrained(cfg.name, local_files_only=True)
    except OSError:
        raise ModelNotFoundError(_not_found(cfg.name)) from None
    model_cls = MODEL_CLASSES.get(cfg.kind if cfg.kind != "auto" else config.model_type)
    if model_cls is None:
        kinds = ", ".join(MODEL_CLASSES)
        raise ValueError(f"{cfg.name}: model_type {config.model_type!r} is not supported (model.kind: {kinds})")
    backbone = _from_pretrained_checked(model_cls, cfg.name)
    _restore(backbone)
    tokenizer, processor = _processors(cfg.processor or cfg.name)
    return wrap(backbone, tokenizer, processor)


def _from_pretrained_checked(model_cls: type[PreTrainedModel], name: str) -> PreTrainedModel:
    """`from_pretrained`, but weights that do not fit the config are an error, not randomly initialised layers."""
    try:
        backbone, info = model_cls.from_pretrained(name, local_files_only=True, output_loading_info=True)
    except pickle.UnpicklingError:  # torch.load(weights_only=True) refused it: never retried unsafely
        raise ValueError(
            f"{name}: its pickled weights (.bin / .pt) hold objects other than tensors, which could run code when "
            "loaded; refused. Use a model.safetensors copy of these weights from a source you trust"
        ) from None
    except Exception as err:
        if "safetensor" not in type(err).__name__.lower() and "deserializ" not in str(err):
            raise
        raise ValueError(f"{_weights_file(name)}: corrupt or truncated safetensors file ({err})") from None
    problems = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):
        found = "; ".join(f"{k.replace('_', ' ')} {v[:6]}{' ...' if len(v) > 6 else ''}" for k, v in problems.items()
                          if v)  # fmt: skip
        raise ValueError(
            f"{name}: the weights do not match its config.json ({found}); a model with these layers randomly "
            "initialised would give meaningless results. Check model.name points at the folder the weights belong to"
        )
    return backbone.eval()


def _weights_file(name: str) -> str:
    folder = Path(name).expanduser()
    found = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    return str(found[0]) if len(found) == 1 else str(folder)


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors state dict; a truncated or malformed file is a ValueError naming it."""
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise
    except Exception as err:  # safetensors' SafetensorError: bad header, file shorter than the header says
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({err})") from None


def _not_found(name: str) -> str:
    """A name that is neither a local path nor a cached hub id: both readings are named, the local one first (a
    mistyped run folder is the commoner slip), so the advice to download never stands alone."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return (
        f"model.name={name!r}: no such local folder or file (from {Path.cwd()}), and not a tiny preset nor a hub id "
        f"in the local HF cache ({cache}). A run or export: check the path. A hub id: sharpclip never downloads; on "
        f"a machine with internet run `hf download {name} --local-dir DIR`, copy DIR here and set model.name=DIR."
    )


def _processors(source: str) -> tuple[Any, Any]:
    """Tokenizer and image processor from a folder / cached hub id; None for what it does not have."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    try:
        processor = AutoImageProcessor.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError):
        processor = None
    return tokenizer, processor


def _restore(backbone: PreTrainedModel) -> None:
    """Re-apply what sharpclip recorded in a saved config: frozen kept positions, the RoPE text tower."""
    text = backbone.text_model
    if getattr(text.config, rope.ROPE_KEY, None):
        rope.to_rope(text, **getattr(text.config, rope.ROPE_KEY))
    else:
        long_context.restore_kept_positions(text)


def apply_structure(model: HFDualEncoder, cfg: ModelConfig) -> None:
    """Stretch, RoPE and adapters as `cfg` asks; each is skipped when the model already has it."""
    text = model.text_model
    if cfg.text_encoder == "rope" and not rope.is_rope(text):
        rope.to_rope(text, cfg.rope_theta, cfg.rope_ntk_factor)
    if rope.is_rope(text):
        if cfg.context_length and cfg.context_length != model.context_length:
            rope.set_rope_context(text, cfg.context_length)
            sync_text_config(model)
    elif cfg.context_length and cfg.context_length != model.context_length:
        long_context.stretch_text_positions(text, cfg.context_length, cfg.keep_positions, model.hf_model)
    if model.tokenizer is not None:
        model.tokenizer.model_max_length = model.context_length
    adapters.add_adapters(model, cfg.adapter)


def sync_text_config(model: HFDualEncoder) -> None:
    """Copy the text tower's sharpclip settings into the dual config (what save_pretrained writes)."""
    text_cfg, dual = model.text_model.config, model.hf_model.config.text_config
    dual.max_position_embeddings = text_cfg.max_position_embeddings
    for key in (rope.ROPE_KEY, long_context.KEEP_KEY):
        if hasattr(text_cfg, key):
            setattr(dual, key, getattr(text_cfg, key))


def apply_training_setup(model: HFDualEncoder, cfg: ModelConfig, init_scale: bool = True) -> None:
    """Logit scale (init unless `init_scale` is False, learnable) and freezing; adapters keep their extras trainable.

    SigLIP's logit bias follows `logit_scale_learnable` with the scale, adapters or not: a frozen temperature with a
    drifting bias would still move the sigmoid's operating point.
    """
    if init_scale and cfg.logit_scale_init is not None:
        with torch.no_grad():
            model.logit_scale.fill_(cfg.logit_scale_init)
    if adapters.is_adapted(model):
        adapters.unfreeze_extras(model, cfg.logit_scale_learnable)
    else:
        model.logit_scale.requires_grad_(cfg.logit_scale_learnable)
        if model.logit_bias is not None:
            model.logit_bias.requires_grad_(cfg.logit_scale_learnable)
    freezing.apply_freezing(model, cfg.freeze)


def save_checkpoint(model: HFDualEncoder, directory: str | Path, cfg: ModelConfig, state: dict | None = None) -> Path:
    """Write the checkpoint layout of the module docstring; `cfg` is the ModelConfig that built `model`; `state`: its
    weights when they were gathered elsewhere (a sharded model's, train.engine), else `model.state_dict()`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sync_text_config(model)
    model.hf_model.config.save_pretrained(directory)
    (directory / CHECKPOINT_CONFIG).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    save_weights(model, directory, state)
    save_processors(model, directory)
    return directory


def save_weights(model: torch.nn.Module, directory: Path, state: dict | None = None) -> None:
    """`model.state_dict()` (or `state`, the same keys gathered elsewhere) as `directory/model.safetensors`, on the
    CPU whatever device the model is on."""
    state = model.state_dict() if state is None else state
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}  # device-free
    save_file(state, str(directory / WEIGHTS), metadata={"format": "pt", "producer": "sharpclip"})


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The state dict `save_weights` wrote into `directory` (FileNotFoundError when absent, ValueError when corrupt)."""
    return load_weights_file(Path(directory) / WEIGHTS)


def save_processors(model: HFDualEncoder, directory: Path) -> None:
    """Save the tokenizer and image processor, where present, beside the weights.

    The tokenizer is saved with `model_max_length` = the text tower's context (248 after a stretch) and without the
    truncation and padding of its last call: a fast tokenizer keeps those in tokenizer.json, transformers reloads
    them as a fixed `max_length` (77), and `processor(text, padding=True)` then warns that it is ignored."""
    if model.tokenizer is not None:
        backend = getattr(model.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # transformers sets both again on every call: nothing else depends on them
            backend.no_truncation()
            backend.no_padding()
        model.tokenizer.init_kwargs.pop("max_length", None)
        model.tokenizer.model_max_length = model.context_length
        model.tokenizer.save_pretrained(directory)
    if model.image_processor is not None:
        model.image_processor.save_pretrained(directory)


def load_checkpoint(directory: str | Path) -> HFDualEncoder:
    """Rebuild exactly what `save_checkpoint` wrote: skeleton from config.json, structure, then the weights."""
    directory = Path(directory)
    stored = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(directory / CHECKPOINT_CONFIG))
    )
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    backbone = _skeleton(config)
    _restore(backbone)
    tokenizer, processor = _processors(str(directory))
    model = wrap(backbone, tokenizer, processor)
    adapters.add_adapters(model, stored.adapter)
    missing, unexpected = model.load_state_dict(read_weights(directory), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{directory / WEIGHTS}: does not match the model rebuilt from {directory}/config.json and "
            f"{CHECKPOINT_CONFIG} (missing {missing[:5]}, unexpected {unexpected[:5]}); was it written by "
            "save_checkpoint with the same sharpclip version?"
        )
    apply_training_setup(model, stored, init_scale=False)  # the trained scale is in the weights
    return model.eval()


def _skeleton(config: PretrainedConfig) -> PreTrainedModel:
    model_cls = MODEL_CLASSES.get(config.model_type)
    if model_cls is None:
        raise ValueError(f"checkpoint model_type {config.model_type!r} is not one of {', '.join(MODEL_CLASSES)}")
    return model_cls(config)


def read_checkpoint_config(directory: str | Path) -> dict[str, Any]:
    """The backbone config.json of a checkpoint or transformers folder, as a dict."""
    return json.loads((Path(directory) / "config.json").read_text())
