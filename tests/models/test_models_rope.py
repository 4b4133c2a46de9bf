"""RoPE text tower: relative-position property, no length limit, mask sliced to the input, NTK, distillation."""

from __future__ import annotations

import random

import pytest
import torch

from sharpclip.config import ModelConfig, TrainConfig
from sharpclip.models import create_model, save_checkpoint, tiny_model
from sharpclip.models.rope import Rotary, RotaryAttention, is_rope, ntk_theta
from sharpclip.train.distill import agreement, distill


def test_rotary_scores_depend_only_on_the_offset() -> None:
    rot = Rotary(head_dim=8, theta=10000.0)
    q, k = torch.randn(8), torch.randn(8)
    seq_q = rot(q.expand(1, 1, 12, 8))[0, 0]  # the same vector at every position
    seq_k = rot(k.expand(1, 1, 12, 8))[0, 0]
    scores = seq_q @ seq_k.T  # (12, 12)
    for offset in (0, 1, 5):
        diag = torch.diagonal(scores, offset)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), atol=1e-5, rtol=0)
    torch.testing.assert_close(seq_q[0], q)  # position 0 is not rotated
    torch.testing.assert_close(seq_q.norm(dim=-1), q.norm().expand(12))


def test_interleaved_pairs_rotate_by_position_times_frequency() -> None:
    rot = Rotary(head_dim=4, theta=100.0)
    x = torch.tensor([1.0, 0.0, 1.0, 0.0]).expand(1, 1, 3, 4)
    out = rot(x)[0, 0, 2]  # position 2: angles 2·100^0 and 2·100^(-1/2)
    expected = torch.tensor([torch.cos(torch.tensor(2.0)), torch.sin(torch.tensor(2.0)), 0, 0])
    expected[2:] = torch.tensor([torch.cos(torch.tensor(0.2)), torch.sin(torch.tensor(0.2))])
    torch.testing.assert_close(out, expected)


def test_ntk_theta_formula() -> None:
    assert ntk_theta(10000.0, 64, 77, 77, 8.0) == 10000.0
    assert ntk_theta(10000.0, 64, 77, 248, 0.0) == 10000.0
    assert ntk_theta(10000.0, 64, 77, 231, 8.0) == pytest.approx(10000.0 * (8 * 3 - 7) ** (64 / 62))


def test_rope_tower_has_no_position_table_and_reads_longer_captions_with_a_sliced_mask() -> None:
    model = create_model(ModelConfig(name="tiny-clip", text_encoder="rope", context_length=248))
    text = model.text_model
    assert is_rope(text) and all(isinstance(layer.self_attn, RotaryAttention) for layer in text.encoder.layers)
    assert not any("position_embedding" in n for n, _ in text.named_parameters())
    tok = model.tokenizer
    short = tok(["a red square"], padding="max_length", max_length=20, return_tensors="pt")["input_ids"]
    longer = tok(["a red square"], padding="max_length", max_length=40, return_tensors="pt")["input_ids"]
    with torch.no_grad():  # causal: padding after eos changes nothing at the pooled token
        torch.testing.assert_close(model.encode_text(short).embedding, model.encode_text(longer).embedding)
        ids = tok(["a red square left of a blue circle ." * 30], truncation=True, return_tensors="pt")["input_ids"]
        assert ids.shape[1] == 248 and model.encode_text(ids).embedding.isfinite().all()


def _captions(count: int, seed: int, max_clauses: int = 4) -> list[str]:
    """SynthDense-style compositional captions: sized, textured, coloured shapes in spatial relations."""
    r = random.Random(seed)
    colour, shape = (
        ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"],
        ["square", "circle", "triangle", "star"],
    )
    size, texture = ["small", "medium", "large"], ["striped", "dotted", "solid", "plain"]
    relation = ["left of", "right of", "above", "below", "near"]

    def obj() -> str:
        return f"a {r.choice(size)} {r.choice(texture)} {r.choice(colour)} {r.choice(shape)}"

    return [
        " . ".join(f"{obj()} {r.choice(relation)} {obj()}" for _ in range(r.randint(1, max_clauses))) + " ."
        for _ in range(count)
    ]


@pytest.fixture
def one_thread():
    """Tiny matrices: one thread is fastest and does not fight other test processes for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_distilled_rope_student_matches_teacher_then_reads_past_its_context(tmp_path, one_thread) -> None:
    torch.manual_seed(0)
    teacher = tiny_model("clip")
    train = TrainConfig(
        output_dir=str(tmp_path / "run"), max_steps=150, batch_size=32, micro_batch_size=32,
        accumulation="per_micro_batch", lr=2e-3, weight_decay=0.0, warmup_steps=10, grad_clip=0.0, eval_every=0,
        progress=False,
    )  # fmt: skip
    held_out = _captions(200, seed=1)
    before = agreement(teacher, create_model(ModelConfig(name="tiny-clip", text_encoder="rope")), held_out)
    student = distill(teacher, _captions(1000, seed=0), train)
    cos = agreement(teacher, student, held_out)
    assert cos >= 0.95 > before  # training, not the initialisation, reaches the bar
    frozen = teacher.text_model.embeddings.token_embedding.weight
    torch.testing.assert_close(student.text_model.embeddings.token_embedding.weight, frozen)
    torch.testing.assert_close(
        student.vision_model.embeddings.patch_embedding.weight, teacher.vision_model.embeddings.patch_embedding.weight
    )
    long = " . ".join(_captions(12, seed=2, max_clauses=4))
    ids = student.tokenizer([long], truncation=True, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > teacher.context_length and student.context_length == 248
    save_checkpoint(student, tmp_path, ModelConfig(name="tiny-clip", text_encoder="rope", context_length=248))
    again = create_model(ModelConfig(name=str(tmp_path)))  # the student replaces the text tower for fine-tuning
    assert is_rope(again.text_model)
    with torch.no_grad():
        torch.testing.assert_close(again.encode_text(ids).embedding, student.encode_text(ids).embedding)
        assert again.encode_text(ids).embedding.isfinite().all()
