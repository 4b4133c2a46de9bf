"""SynthDense: procedurally drawn scenes with dense compositional captions, the project's embedded default task.

Why: no pretrained weights or benchmark images exist here, yet HN-CLIP's claim (near-duplicate captions stay
confused after coarse pre-training) needs long captions that share most of their words. SynthDense builds exactly that
(what the demo measures with it: docs/reproduction.md).

A scene is a background and 3-5 objects, each with a shape (8), colour (8), size (2), texture (3) and a cell of a 3×3
grid. Everything is a pure function of (seed, split, index): `random.Random(f"{seed}:{split}:{index}")`.

- Families: a base scene plus near-duplicates that change one (60 %) or two attributes of one object (test
  families: of each of `test_changed_objects` objects, 1 by default).
- Captions: dense (≥ 80 words: background, every object with all attributes and position in reading order, the
  relation of each object to the next in reading order, counts; more relations or a closing sentence are added until
  the caption reaches 80 words), two variants of it (`caption_layout` without the objects' size and texture;
  `caption_noisy` with each size and texture word drawn at random, unrelated to the image, with probability
  `detail_random_p`, 1 by default) and two coarse levels, `shapes`
  ("a picture of a circle, a square and a star.") and `colours` ("a picture of a red circle, ...").
- Edits (CLIP-IN / UltraEdit style): change colour, shape, size or position of an object, add or remove one; source
  and target images with their dense captions and the instruction.
- MMVP-style pairs: two images that differ in one visual pattern (colour, count, position, size, presence, texture),
  each with a statement true of it only.
- Zero-shot classes: single-object scenes, one class per colour + shape ("red circle", 64 classes), any size,
  texture, cell and background; read by the `zeroshot` evaluation suite as an image folder with the coarse captions'
  prompt ("a picture of a {}.").

The package, lowest module first: `scene` (attribute values, objects, near-duplicate changes), `captions`
(dense, layout, noisy and coarse captions, families, the vocabulary), `edits` (edit and MMVP-style pairs),
`render` (drawing a scene) and `corpus` (records per split, the writer pool, the manifest).

`corpus.generate(root, cfg)` writes it in the generic format (so the ordinary loaders read it):

    root/manifest.json, vocab.txt, images/<split>/<index>.png,
    train.jsonl, test.jsonl, pretrain.jsonl   {id, image, caption, caption_layout, caption_noisy, short_caption,
                                               caption_shapes, caption_colours, group, variant}
    edits.jsonl                               {id, source_image, edited_image, source_caption, target_caption,
                                               instruction, kind}
    mmvp.jsonl                                {id, image, caption, group, pattern}  (two rows per pair)
    zeroshot.jsonl, images/zeroshot/<colour>_<shape>/<index>.png, zeroshot_prompts.txt
                                              {id, image, label}
"""
