"""Long-CLIP stretch: exact values on a ramp, frozen first rows under a real optimiser step, save/reload."""

from __future__ import annotations

import pytest
import torch

from sharpclip.config import ModelConfig
from sharpclip.models import create_model, load_checkpoint, save_checkpoint
from sharpclip.models.long_context import KeptPositionEmbedding, stretch_positions


def test_ramp_77_to_248_gives_datasets_md_values() -> None:
    old = torch.arange(77, dtype=torch.float32)[:, None].repeat(1, 3)  # old[j] = j
    new = stretch_positions(old, keep=20, factor=4)[:, 0]
    assert new.shape == (248,)
    assert new[:20].tolist() == list(range(20))
    assert new[20::4][:57].tolist() == [20 + m for m in range(57)]  # old[j] lands at 20 + 4(j - 20)
    assert new[21:24].tolist() == [20.25, 20.5, 20.75]
    assert new[244:].tolist() == [76.0, 76.25, 76.5, 76.75]


def test_stretch_matches_the_loop_formula_on_random_rows() -> None:
    old = torch.randn(64, 5, generator=torch.Generator().manual_seed(0))
    new = stretch_positions(old, keep=20, factor=4)
    assert new.shape == (4 * 64 - 3 * 20, 5) == (196, 5)
    expected = [old[p] for p in range(20)]
    for i in range(64 - 20 - 1):
        expected += [((4 - j) * old[20 + i] + j * old[21 + i]) / 4 for j in range(4)]
    expected += [old[63] + j * (old[63] - old[62]) / 4 for j in range(4)]
    torch.testing.assert_close(new, torch.stack(expected))


@pytest.mark.parametrize(("kind", "length"), [("clip", 248), ("siglip", 196)])
def test_stretched_tower_keeps_first_rows_frozen_through_adamw(kind: str, length: int) -> None:
    model = create_model(ModelConfig(name=f"tiny-{kind}", context_length=length))
    emb = model.text_model.embeddings.position_embedding
    assert isinstance(emb, KeptPositionEmbedding) and model.context_length == length
    assert model.tokenizer.model_max_length == length
    before = emb.table().detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ids = model.tokenizer(["a red square " * 60], truncation=True, padding="max_length", return_tensors="pt")
    model.encode_text(ids["input_ids"]).embedding.sum().backward()
    opt.step()
    after = emb.table().detach()
    assert torch.equal(after[:20], before[:20])
    assert (after[20:] - before[20:]).abs().amax(-1).gt(0).all()  # every stretched row moved


def test_stretched_model_saves_and_reloads_with_its_length_and_frozen_rows(tmp_path) -> None:
    cfg = ModelConfig(name="tiny-clip", context_length=248)
    model = create_model(cfg)
    with torch.no_grad():
        model.text_model.embeddings.position_embedding.weight.add_(1.0)  # trained rows differ from the kept ones
    save_checkpoint(model, tmp_path, cfg)
    again = load_checkpoint(tmp_path)
    emb = again.text_model.embeddings.position_embedding
    assert isinstance(emb, KeptPositionEmbedding) and emb.keep == 20 and again.context_length == 248
    torch.testing.assert_close(emb.table(), model.text_model.embeddings.position_embedding.table())
    ids = again.tokenizer(["a blue circle " * 90], truncation=True, return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 248
    torch.testing.assert_close(again.encode_text(ids).embedding, model.eval().encode_text(ids).embedding)


def test_unreachable_length_names_the_reachable_ones() -> None:
    with pytest.raises(ValueError, match=r"248"):
        create_model(ModelConfig(name="tiny-clip", context_length=200))
