"""The eval manifest: everything known to move a score, written beside every eval report (`eval_manifest.json`).

Two runs whose manifests agree (except timestamps) evaluated the same weights on the same bytes the same way:
model identity and a hash of its weights, image size / interpolation / mean / std, text context length and how many
captions were truncated, the prompt set, the ranking tie policy and metric definitions, and every dataset file read:
the annotation files each reader reports having opened (`files` of a RetrievalSet / ChoiceSet / ClassificationSet,
filled by the format readers through `BadSampleReport.read_file`), with size and sha256, and nothing else under the
suite's root; images counted with their total size, hashed only under `eval.hash_images` (a benchmark's images run
to gigabytes). Images held inside a dataset file (parquet / Arrow cells, a zip member read into memory) count as
`embedded`: their bytes are part of the listed files, so the size counts image files only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from sharpclip.data.files import open_regular
from sharpclip.data.images import image_bytes
from sharpclip.data.schema import ArrowCell, ParquetCell
from sharpclip.eval.metrics import METRIC_DEFINITIONS, TIE_POLICY


def sha256_file(path: str | Path, block: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in `block`-sized chunks."""
    h = hashlib.sha256()
    with open_regular(path) as f:  # a FIFO or device is refused, never waited on
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 over the state dict: every tensor's name, dtype, shape and bytes, in sorted name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


DIGEST_CACHE = "weights_digests.json"  # in $SHARPCLIP_CACHE (default ~/.cache/sharpclip)
DIGEST_CACHE_ENTRIES = 256


def cached_weights_sha256(module: torch.nn.Module, sources: Sequence[Path], settings: str, cache_dir: Path) -> str:
    """`weights_sha256(module)`, remembered in `cache_dir`/weights_digests.json under the files the module was loaded
    from (each one's resolved path, size and mtime_ns) and `settings` (whatever else shaped the weights: the model
    config, the versions): a later load of the same unchanged files reuses it instead of hashing every tensor again
    (seconds for ViT-L). Without sources (a tiny preset) or a readable cache, it is computed; an unwritable cache is
    skipped."""
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(sources)]
    key = hashlib.sha256(json.dumps([stats, settings]).encode()).hexdigest() if stats else ""
    path = cache_dir / DIGEST_CACHE
    try:
        cache = json.loads(path.read_text(encoding="utf-8")) if key else {}
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    if isinstance(cache.get(key), str):
        return cache[key]
    digest = weights_sha256(module)
    if key:
        cache = {k: v for k, v in list(cache.items())[-(DIGEST_CACHE_ENTRIES - 1) :]} | {key: digest}
        with contextlib.suppress(OSError):
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{DIGEST_CACHE}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache) + "\n", encoding="utf-8")
            os.replace(tmp, path)
    return digest


def file_record(path: Path) -> dict[str, Any]:
    """{path, bytes, sha256} of one file."""
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def dataset_record(files: Iterable[Path], images: Sequence[Any] = (), hash_images: bool = False) -> dict[str, Any]:
    """Annotation files with size and sha256; image paths counted with total bytes (and hashed when asked)."""
    paths = [Path(p) for p in files]
    record: dict[str, Any] = {"files": [file_record(p) for p in paths if p.is_file()]}
    image_paths = [Path(getattr(r, "path", r)) for r in images if isinstance(getattr(r, "path", r), str | Path)]
    existing = [p for p in dict.fromkeys(image_paths) if p.is_file()]
    embedded = [*dict.fromkeys(r for r in images if isinstance(r, ParquetCell | ArrowCell))]
    embedded += [r for r in images if isinstance(r, bytes)]  # in-memory images (a zip's members): one each
    record["images"] = {
        "count": len(existing) + len(embedded),
        "bytes": sum(p.stat().st_size for p in existing),
        "embedded": len(embedded),
    }
    if hash_images:
        h = hashlib.sha256()  # over "name|sha256" lines sorted, so the digest does not depend on reading order
        lines = [f"{p.name}|{sha256_file(p)}\n" for p in existing]
        lines += [
            f"{_cell_name(r, i)}|{hashlib.sha256(image_bytes(r) or b'').hexdigest()}\n" for i, r in enumerate(embedded)
        ]
        for line in sorted(lines):
            h.update(line.encode())
        record["images"]["sha256_of_sorted_list"] = h.hexdigest()
    return record


def _cell_name(source: Any, index: int) -> str:
    """A stable name of an embedded image: its file and position, or its index among in-memory images."""
    if isinstance(source, ParquetCell):
        return f"{Path(source.file).name}[{source.row_group},{source.row}]"
    if isinstance(source, ArrowCell):
        return f"{Path(source.file).name}[{source.row}]"
    return f"embedded[{index}]"


ALPHA_RECORD = {  # what each data.images.to_rgb policy does to a transparent pixel
    "drop": 'drop: PIL convert("RGB"), alpha discarded, the colour under it kept (OpenAI CLIP, Long-CLIP, GOAL)',
    "white": "white: composited onto white (HF CLIPImageProcessor's convert_to_rgb)",
}


def preprocessing_record(preprocess: Any) -> dict[str, Any]:
    """Image size, interpolation, alpha policy, mean and std of a ClipImageTransform-like object (None where
    unknown)."""
    mean, std = getattr(preprocess, "mean", None), getattr(preprocess, "std", None)
    return {
        "class": type(preprocess).__name__,
        "image_size": getattr(preprocess, "size", None),
        "interpolation": getattr(preprocess, "interpolation", "bicubic (PIL), shorter side, then centre crop"),
        "alpha": ALPHA_RECORD.get(getattr(preprocess, "alpha", None), getattr(preprocess, "alpha", None)),
        "mean": [float(x) for x in torch.as_tensor(mean).flatten()] if mean is not None else None,
        "std": [float(x) for x in torch.as_tensor(std).flatten()] if std is not None else None,
    }


def model_record(model: torch.nn.Module, name: str = "") -> dict[str, Any]:
    """Model identity: configured name, class, parameter count and a weight hash; safetensors files if `name` is a
    local folder."""
    record: dict[str, Any] = {
        "name": name,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_sha256": weights_sha256(model),
    }
    folder = Path(name) if name else None
    if folder is not None and folder.is_dir():
        record["files"] = [file_record(p) for p in sorted(folder.glob("*.safetensors"))]
    return record


def environment_record() -> dict[str, Any]:
    """Versions of python, torch, transformers and sharpclip (None where not importable)."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "sharpclip"):
        try:
            versions[pkg] = __import__(pkg).__version__
        except (ImportError, AttributeError):
            versions[pkg] = None
    return versions


def build_manifest(
    *,
    model: dict[str, Any],
    image: dict[str, Any],
    text: dict[str, Any],
    prompts: dict[str, Any],
    datasets: dict[str, Any],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """Assemble the manifest; each argument is a ready record (see the *_record helpers)."""
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": model,
        "image_preprocessing": image,
        "text": text,
        "prompts": prompts,
        "tie_policy": TIE_POLICY,
        "metric_definitions": METRIC_DEFINITIONS,
        "datasets": datasets,
        "settings": settings,
        "environment": environment_record(),
    }
