"""ShareGPT4V (Long-CLIP's ShareGPT4V-1k): `share-captioner_coco_lcs_sam_1246k_1107.json` under the `data/` root.

A JSON list of `{id, image, conversations: [{from: human, ...}, {from: gpt, value: <long caption>}]}`; `image` is
relative to the root (`sam/images/sa_545504.jpg`, `coco/train2017/...`). Long-CLIP's protocol: test = the first
`data.sharegpt4v_test_size` (1,000) records, train = the rest; caption = `conversations[1].value` with newlines
replaced by spaces; short caption = the caption up to its first ". ".
"""

from __future__ import annotations

from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats._common import caption_ok, check_split, fields, load_json
from sharpclip.data.schema import BadSample, BadSampleReport, PairSample

ANNOTATIONS = "share-captioner_coco_lcs_sam_1246k_1107.json"


def _caption(conversations: object) -> str | None:
    if isinstance(conversations, list) and len(conversations) > 1 and isinstance(conversations[1], dict):
        value = conversations[1].get("value")
        return value.replace("\n", " ") if isinstance(value, str) else None
    return None


def _sample(record: object, index: int, root: Path, where: str, report: BadSampleReport) -> PairSample | None:
    rid = str(record.get("id", index)) if isinstance(record, dict) else str(index)
    got = fields(record, ("image", "conversations"), where, rid, report)
    if got is None:
        return None
    caption = _caption(got[1])
    if caption is None:
        report.add(BadSample(where, rid, "malformed record: conversations[1].value is not a caption"))
        return None
    if not caption_ok(caption, where, rid, report):
        return None
    return PairSample(id=rid, image=root / got[0], caption=caption, short_caption=caption.split(". ")[0], source=where)


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """ShareGPT4V samples: the first `data.sharegpt4v_test_size` records (test) or the rest (train)."""
    check_split("sharegpt4v", split, ("train", "test"))
    path = root / (cfg.annotation_file or ANNOTATIONS)
    records = load_json(path, "ShareGPT4V annotation JSON", report)
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of conversation records")
    n = cfg.sharegpt4v_test_size
    start, stop = (0, n) if split == "test" else (n, len(records))
    samples = [_sample(records[i], i, root, f"{path}[{i}]", report) for i in range(start, min(stop, len(records)))]
    return [s for s in samples if s is not None]
