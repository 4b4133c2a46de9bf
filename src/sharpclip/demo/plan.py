"""What the demo runs: the sizes of each mode (quick / default / full) and the fine-tuning arms as config overrides.

Every arm starts from the same stage-A2 initialisation with the same seed and the same budget (optimiser steps at the
same batch size), so the table compares objectives and nothing else. The arms:

    (a) infonce        InfoNCE, HN-CLIP eq. 1 (the control)
    (b) hn             HN-CLIP eq. 2, γ = 0.5, Ḡ recomputed every step
    --full adds (and --arms picks from)
    (c) hn_tok         HN-CLIP eq. 3: eq. 2 + FILIP token-level term
    (d) clipin         CLIP-IN eq. 8 stage 2: short + long captions + edit hard negatives (train + edits in one epoch;
                       exact accumulation, as its edit pairs must share one matrix)
    (d0) clipin_noedit (d) without the edit term (what the edit negatives add, at equal data and budget)
    (d1) clipin_long   (d0) without the short-caption term: InfoNCE on the same rows (what short + long captions add)
    (a') infonce_exact (a) with exact accumulation: one 128 × 128 matrix from the same 8 micro-batches
    (b') hn_exact      (b) likewise
    (e) hn_frozen      HN-CLIP with Ḡ from the frozen initial text tower (Table 3c)
    (f) hn_g*          the γ sweep {0.25, 0.75, 1.0} (0.5 is (b))
    (g) lora_*         LoRA (rank 8, both towers) with InfoNCE and with the boost
    (h) hn_learn_s     (b) with a learnable logit scale (the others freeze it; the margin can pull s down)
    (i) hn_paper_spread HN-CLIP at the paper's spread in logits: γ such that s·γ·(h̄ − p̄) on the init's test
                       captions equals the mean of HN-CLIP Fig. 1's three (3.67 logits at γ 0.5, s 100;
                       analysis.geometry.paper_spread), rounded to 3 significant digits (at_paper_spread). The rule
                       was fixed before any run of this arm: the same γ 0.5 means ~12× the paper's spread on the
                       default task's init, whose captions sit much farther from their hardest negative

The default runs (a) and (b), HN-CLIP's comparison, in the ≤ 5 min a cached demo may take on 2 quiet cores; CLIP-IN's
arm costs 2.3 InfoNCE arms here (a second caption through the text tower, exact accumulation) and is one
`--arms clipin` away. Sizes are scaled to what 2 CPU cores do in that budget (docs/reproduction.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Profile:
    """Sizes of one demo mode. Steps are optimiser steps of `batch_size` rows (the same for every arm)."""

    name: str
    # model (config.TinyConfig): width 96, 4 layers, 64 px ran at only 25-55 samples/s on these 2 shared cores, so
    # the default is smaller: width 64, 2 layers per tower, 48 px images
    width: int
    layers: int
    image_size: int
    context_length: int = 152  # dense captions run to 141 tokens with bos/eos; 152 = 20 + 11 · (32 − 20) (see below)
    patch_size: int = 8
    # SynthDense
    # the fine-tuning set: 1,920 independent scenes + 320 detail pairs (a scene and its near-duplicate differing only
    # in the size or texture of one object) = 2,560 rows, 20 steps per epoch at batch 128. The sampler places whole
    # groups first in each batch, so the 16 pairs of a batch fill its first two micro-batches of 16 (hard: InfoNCE
    # learns the details only there) and the other six hold independent scenes (easy: they saturate)
    train_families: int = 1920
    train_family_size: int = 1  # 1: independent scenes; 6: near-duplicate families in batches
    train_detail_pairs: int = 320
    test_families: int = 300  # × 6 near-duplicates = 1,800 test pairs (noise bar: see demo.report.noise)
    test_variants: str = "details"  # test siblings differ in size / texture only: what stage A2 learnt to ignore
    test_changed_objects: int = 1  # objects each test (and validation) near-duplicate changes (SynthDense's field)
    val_families: int = 40  # a second corpus (another seed): the per-epoch convergence curves
    edits: int = 512
    mmvp_pairs: int = 30  # per visual pattern (6 patterns: 180 pairs)
    zeroshot_per_class: int = 4  # the forgetting guard: 64 colour + shape classes of single-object scenes
    pretrain_scenes: int = 8192
    # stage A (the strong initialisation): shape + colour coarse captions, from scratch, at a
    # 32-token context (coarse captions have at most 25 tokens), then stretched to `context_length` by Long-CLIP's
    # rule (first 20 positions kept and frozen, the other 12 interpolated by an integer factor, here 11): the text
    # tower costs ~4.5× less in stage A
    init_steps: int = 600
    init_lr: float = 1e-3
    init_batch_size: int = 128
    init_context_length: int = 32
    # stage A2 (Long-CLIP's stage): stage A stretched to `context_length`, InfoNCE with a learnable scale on dense
    # captions of the same pre-training scenes whose size and texture words are random (unrelated to the image)
    a2_steps: int = 192
    a2_split: str = "pretrain_noisy"  # dense captions whose size and texture words are random (pretrain_layout: none)
    a2_lr: float = 3e-4
    a2_batch_size: int = 128
    # the probability that each size / texture word of A2's `pretrain_noisy` captions is drawn at random instead of
    # being the image's (SynthDense's detail_random_p): 1 = every detail word random, 0 = the true captions
    a2_detail_random_p: float = 1.0
    a2_scale: float = 0.0  # > 0: A2's logit scale frozen at this value (above 100 too); 0: learnable, from stage A's
    # > 0: A2 also trains on this many pre-training detail pairs (a scene and its near-duplicate in the size or texture
    # of one object, in one batch), so the init can learn the details as far as A2's captions state them
    a2_detail_pairs: int = 0
    # stage B (each arm), the paper's regime: 128 rows a step as 8 micro-batches of 16, each its own InfoNCE problem
    # (HN-CLIP's effective batch of 128 = 16 × 8), scale frozen at `scale`; lr from the sweep in docs/reproduction.md
    steps: int = 200  # 10 epochs of 2,560 rows, as HN-CLIP's recipe
    # the arms' frozen logit scale (the learnable-s arm starts there): 100, Long-CLIP's own, as in the paper; a task
    # whose A2 trains at a frozen scale fine-tunes at that scale, the init's own
    scale: float = 100.0
    batch_size: int = 128
    micro_batch_size: int = 16
    lr: float = 1e-4
    # rows per forward pass of the per_micro_batch arms (speed only, same gradients): 4 micro-batches of 16 a pass
    # (benchmarks/encode_passes.py); the exact arms encode the whole batch in one pass
    encode_batch_size: int = 64
    diagnostics: int = 10  # gradient measurements in the InfoNCE arm (each costs two extra forward-backward passes)


PROFILES = {
    "quick": Profile(
        "quick", width=32, layers=2, image_size=32, train_families=112, train_detail_pairs=8, test_families=8,
        val_families=4, edits=32, mmvp_pairs=2, zeroshot_per_class=1, pretrain_scenes=512, init_steps=24,
        init_batch_size=32, a2_steps=8, a2_batch_size=32, steps=8, encode_batch_size=16,
        batch_size=32, micro_batch_size=8, lr=1e-3, diagnostics=2,
    ),
    "default": Profile("default", width=64, layers=2, image_size=48),
}  # fmt: skip


# The target tasks `sharpclip demo --task NAME` fine-tunes on: changes of the mode's Profile (a function of it, so
# --quick keeps its sizes), applied before --set. Both fine-tune on the same corpus with the same arms; they differ
# in the init (stage A2), hence in its cache key.
# - paper-geometry (the default): an init that half-sees the details, as HN-CLIP's Long-CLIP already ranks many
#   near-duplicates right: A2 reads the true captions and also trains on a quarter as many detail pairs of its own
#   scenes as it has scenes (both halves in one batch; 2,048 at the default size), for twice the steps (384) with the
#   scale frozen at 500: the higher A2's scale, the less of stage A's shared direction InfoNCE spreads away (mean
#   pairwise caption cosine 0.29 at 100, 0.82 at 500). The arms fine-tune at the init's own scale, 500, as HN-CLIP
#   fine-tunes Long-CLIP at its own 100 (at 100 this init's InfoNCE saturates 9 % of its micro-batches, at 500 64 %).
#   Of the A2 variants measured whose within-family R@1 is in the regime check's range, it is the one closest to the
#   paper's caption geometry (docs/reproduction.md, Choosing the init); it was chosen, and InfoNCE's saturation and
#   headroom from it checked, before any HN-CLIP run from it.
# - unseen-details: A2's detail words are all random, so the init cannot see size or texture at all (its test
#   captions' hardest negative sits at cosine ≈ 1): the task asks for a feature the init lacks.
def _paper_geometry(p: Profile) -> dict[str, float | int]:
    own_scale = 500.0  # A2 trains at it and the arms fine-tune at it
    return {
        "a2_detail_random_p": 0.0,
        "a2_scale": own_scale,
        "scale": own_scale,
        "a2_detail_pairs": p.pretrain_scenes // 4,
        "a2_steps": 2 * p.a2_steps,
    }


TASKS: dict[str, Callable[[Profile], dict[str, float | int]]] = {
    "paper-geometry": _paper_geometry,
    "unseen-details": lambda p: {},
}
DEFAULT_TASK = "paper-geometry"


def task_profile(task: str, quick: bool = False) -> Profile:
    """The mode's sizes (quick or default) with the task's changes; an unknown task is a ValueError."""
    if task not in TASKS:
        raise ValueError(f"--task {task!r}: unknown; known: {', '.join(TASKS)}")
    p = PROFILES["quick" if quick else "default"]
    return replace(p, **TASKS[task](p))


@dataclass(frozen=True)
class Arm:
    """One fine-tuning run: a name (run sub-folder), a table label and config overrides on top of the base."""

    name: str
    label: str
    overrides: tuple[str, ...] = ()
    terms: dict[str, str] = field(default_factory=dict)  # term name -> inline YAML of its TermConfig


INFONCE = {"clip": "{loss: infonce}"}


def _hn(gamma: float = 0.5, frozen: bool = False) -> dict[str, str]:
    inputs = ", inputs: {reference_text: text_frozen}" if frozen else ""
    return {"hn": f"{{loss: hn_clip, params: {{gamma: {gamma}}}{inputs}}}"}


def _clipin(edits: bool, short: bool = True) -> dict[str, str]:
    terms = {"long": "{loss: infonce}"}
    if short:
        terms["short"] = "{loss: infonce, inputs: {text: text_short}}"
    if edits:
        terms["edits"] = "{loss: edit_negatives}"
    return terms


# LoRA trains few parameters from a fixed point: 3× the full fine-tuning rate (the same for both LoRA arms)
LORA = ("model.adapter.method=lora", "model.adapter.rank=8", "model.adapter.alpha=16", "train.lr=1e-3")
# edit pairs must share a contrastive matrix: CLIP-IN trains on the whole batch of 128 (exact accumulation)
CLIPIN_DATA = ("data.train_split=train+edits", "train.accumulation=exact")
EXACT = ("train.accumulation=exact",)  # one 128 × 128 matrix from the same 8 micro-batches (sharpclip's addition)


PAPER_SPREAD_ARM = "hn_paper_spread"  # its γ is set from the init's caption geometry (at_paper_spread)


def core_arms() -> list[Arm]:
    return [
        Arm("infonce", "(a) InfoNCE", terms=INFONCE),
        Arm("hn", "(b) HN-CLIP γ=0.5", terms=_hn()),
    ]


def full_arms() -> list[Arm]:
    return [
        Arm("hn_tok", "(c) HN-CLIP + token", terms={**_hn(), "tok": "{loss: filip, weight: 1.0}"}),
        Arm("clipin", "(d) CLIP-IN stage 2", CLIPIN_DATA, terms=_clipin(edits=True)),
        Arm("clipin_noedit", "(d0) CLIP-IN, no edit term", CLIPIN_DATA, terms=_clipin(edits=False)),
        Arm("clipin_long", "(d1) CLIP-IN data, long captions only", CLIPIN_DATA, terms=_clipin(False, short=False)),
        Arm("infonce_exact", "(a') InfoNCE, exact 128 × 128", EXACT, terms=INFONCE),
        Arm("hn_exact", "(b') HN-CLIP, exact 128 × 128", EXACT, terms=_hn()),
        Arm("hn_frozen", "(e) HN-CLIP, Ḡ frozen", terms=_hn(frozen=True)),
        *[Arm(f"hn_g{g}", f"(f) HN-CLIP γ={g}", terms=_hn(g)) for g in (0.25, 0.75, 1.0)],
        Arm("lora_infonce", "(g) LoRA InfoNCE", LORA, terms=INFONCE),
        Arm("lora_hn", "(g) LoRA HN-CLIP", LORA, terms=_hn()),
        Arm("hn_learn_s", "(h) HN-CLIP, learnable s", ("model.logit_scale_learnable=true",), terms=_hn()),
        Arm(PAPER_SPREAD_ARM, "(i) HN-CLIP, paper's spread (γ from the init)", terms=_hn()),
    ]


def at_paper_spread(plan: list[Arm], gamma: float) -> list[Arm]:
    """`plan` with the paper-spread arm's γ set: `gamma` (analysis.geometry.gamma_for_spread of the init's test
    captions at the arms' scale) rounded to 3 significant digits, and written into its label."""
    g = float(f"{gamma:.3g}")
    label = f"(i) HN-CLIP, paper's spread (γ={g:g})"
    return [replace(a, label=label, terms=_hn(g)) if a.name == PAPER_SPREAD_ARM else a for a in plan]


def arms(full: bool) -> list[Arm]:
    return core_arms() + (full_arms() if full else [])


def term_overrides(arm: Arm) -> list[str]:
    return [f"loss.terms.{name}={spec}" for name, spec in arm.terms.items()]
