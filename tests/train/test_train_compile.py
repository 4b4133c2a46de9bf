"""`train.compile` over the trainer's real shape mix: the towers stay compiled (no recompile limit hit, a stated
number of graphs), only Dynamo/Inductor failures are reported as compile failures, and compile is refused where it
could break the exactness of the cached-gradient replay (dropout under exact accumulation).

Dynamo's guards and recompiles do not depend on the backend, so `backend="eager"` keeps these tests cheap.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.config import ConfigError, LossConfig, TermConfig
from sharpclip.train import trainer as trainer_module
from sharpclip.train.compile import COMPILE_GRAPH_BUDGET, compile_blocks
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.step import run_step, split_rows
from sharpclip.train.trainer import Trainer

TERMS = {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip", weight=0.5)}


@pytest.fixture
def dynamo():
    """A fresh Dynamo whose recompile limit is a hard error; reset again afterwards (one process, many tests). Dynamo's
    own `config.patch` restores the settings (monkeypatch's undo would delete the aliased names from the module)."""
    torch._dynamo.reset()
    counters.clear()
    limit = torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=limit):
        yield
    torch._dynamo.reset()


def _wider(batch, width: int, pad_id: int):
    extra = width - batch.input_ids.shape[1]
    return replace(batch, input_ids=F.pad(batch.input_ids, (0, extra), value=pad_id),
                   attention_mask=F.pad(batch.attention_mask, (0, extra)))  # fmt: skip


def test_compile_is_per_transformer_block_not_per_tower():
    """torchtitan's unit: each block compiled in place (the engine's reduce-scatter then follows block by block), the
    towers, embeddings and projections eager; parameter names unchanged."""
    model = toy_model()
    names = [n for n, _ in model.named_parameters()]
    blocks = [block for tower in (model.vision_model, model.text_model) for block in tower.encoder.layers]
    assert compile_blocks(model, backend="eager") == len(blocks) == 4
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert model.vision_model._compiled_call_impl is None and model.text_model._compiled_call_impl is None
    assert [n for n, _ in model.named_parameters()] == names


def test_the_blocks_stay_compiled_over_the_trainer_shape_mix(dynamo):
    model = toy_model()
    compile_blocks(model, backend="eager")
    objective = build_objective(LossConfig(terms=TERMS))
    encoder = FeatureEncoder(model, objective.feature_keys)
    batches = list(ToyLoader(model.tokenizer, n=64, batch_size=16))
    width, pad = batches[0].input_ids.shape[1], model.tokenizer.pad_token_id or 0
    run_step(encoder, objective, batches[0], 4, "exact")  # no-grad encode and replay, both towers
    for k in range(1, 5):  # new caption widths
        run_step(encoder, objective, _wider(batches[k % 4], width + 8 * k, pad), 4, "exact")
    run_step(encoder, objective, split_rows(batches[1], 14)[0], 4, "exact")  # a short last micro-batch (2 rows)
    run_step(encoder, objective, batches[2], 16, "exact")  # one micro-batch: nothing cached
    run_step(encoder, objective, batches[3], 4, "per_micro_batch", encode_batch_size=8)
    model.eval()
    with torch.no_grad():  # validation batches of 64 and a last one of 37
        for rows in (64, 37):
            model.encode_image(batches[0].pixel_values[:1].expand(rows, -1, -1, -1))
            model.encode_text(batches[0].input_ids[:1].expand(rows, -1), batches[0].attention_mask[:1].expand(rows, -1))
    graphs = counters["stats"]["unique_graphs"]
    assert 4 <= graphs <= COMPILE_GRAPH_BUDGET
    assert not counters["graph_break"]


def test_only_dynamo_and_inductor_errors_are_reported_as_compile_failures(tmp_path, monkeypatch):
    def compile_then_oom(model, backend="inductor", fullgraph=False):
        def oom(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        model.vision_model.forward = oom

    monkeypatch.setattr(trainer_module, "compile_blocks", compile_then_oom)
    model = toy_model()
    cfg = train_config(str(tmp_path / "run"), max_steps=1, compile=True)
    objective = build_objective(LossConfig(terms=TERMS))
    trainer = Trainer(model, objective, ToyLoader(model.tokenizer), cfg, tmp_path / "run", lambda d: None)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        trainer.fit()


def test_an_error_raised_from_a_dynamo_error_counts_as_one():
    try:
        try:
            raise torch._dynamo.exc.Unsupported("data-dependent branch")
        except Exception as inner:
            raise RuntimeError("while tracing the text tower") from inner
    except RuntimeError as err:
        assert trainer_module.is_compile_error(err)
    assert not trainer_module.is_compile_error(RuntimeError("NCCL error: unhandled system error"))


@pytest.mark.parametrize(("accumulation", "refused"), [("exact", True), ("per_micro_batch", False)])
def test_compile_with_dropout_under_exact_accumulation_is_refused(tmp_path, accumulation, refused, monkeypatch):
    monkeypatch.setattr(trainer_module, "compile_blocks", lambda model, **options: None)  # the check comes first
    model = toy_model(attention_dropout=0.1)
    cfg = train_config(str(tmp_path / "run"), compile=True, accumulation=accumulation)
    objective = build_objective(LossConfig(terms=TERMS))
    build = lambda: Trainer(model, objective, ToyLoader(model.tokenizer), cfg, tmp_path / "run", lambda d: None)  # noqa: E731
    if refused:
        with pytest.raises(ConfigError, match=r"^train\.compile: the model has dropout \(rate 0\.1\)"):
            build()
    else:
        build()


def test_fullgraph_compiles_each_block_whole_and_the_counts_say_so(dynamo):
    """`train.compile_fullgraph`: every block is one graph or an error; the counts the trainer logs read Dynamo's."""
    from sharpclip.train.compile import compile_counts

    model = toy_model()
    compile_blocks(model, backend="eager", fullgraph=True)
    objective = build_objective(LossConfig(terms=TERMS))
    encoder = FeatureEncoder(model, objective.feature_keys)
    run_step(encoder, objective, next(iter(ToyLoader(model.tokenizer, batch_size=8))), 4, "exact")
    counts = compile_counts()
    assert counts["graph_breaks"] == 0 and counts["graphs"] >= 2  # both towers' blocks, no-grad and grad
