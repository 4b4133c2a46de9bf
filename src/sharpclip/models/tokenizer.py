"""An offline CLIP tokenizer built in code from a word list (tests, the demo and SynthDense).

The real CLIP tokenizer needs its 49k-entry BPE vocabulary from the hub; these machines have none. This module learns
a tiny byte-pair encoding over a given word list, with the same normaliser, pre-tokeniser and post-processor as
OpenAI's (it *is* a `transformers.CLIPTokenizer`, so `save_pretrained` / `from_pretrained` round-trip offline and
the export writes it next to the model).

Layout of the vocabulary (mirrors OpenAI's, where `<|startoftext|>` = 49406 and `<|endoftext|>` = 49407 are last):

    0                 <|unk|>          (a character outside the alphabet; never the end-of-text id)
    1 .. 2A           the alphabet, bare and with the end-of-word suffix `</w>`
    ...               merged tokens, in merge order (every listed word ends as one token)
    V-2               <|startoftext|>  (bos)
    V-1               <|endoftext|>    (eos = pad; the largest id, so argmax pooling also finds it)

HF's `CLIPTextModel` pools at the first position equal to `config.eos_token_id` (docs/method-notes.md §8), so a model
built for this tokenizer must set `eos_token_id = tokenizer.eos_token_id`; `tiny.tiny_clip_config` does.
"""

from __future__ import annotations

import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise

from transformers import AutoTokenizer, CLIPTokenizer

from sharpclip.data.synthdense.captions import vocabulary
from sharpclip.data.transforms import TextTokenizer

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
UNK = "<|unk|>"
EOW = "</w>"  # CLIP's end-of-word suffix
ALPHABET = string.ascii_lowercase + string.digits + string.punctuation  # the normaliser lowercases first


def _pieces(words: Iterable[str]) -> list[str]:
    """Words split exactly as CLIPTokenizer's normaliser and pre-tokeniser will split them at encode time."""
    backend = CLIPTokenizer().backend_tokenizer
    out: set[str] = set()
    for text in words:
        normalised = backend.normalizer.normalize_str(text)
        out.update(piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(normalised))
    return sorted(out)


def _symbols(piece: str) -> tuple[str, ...]:
    return (*piece[:-1], piece[-1] + EOW)


def _learn_merges(pieces: list[str]) -> list[tuple[str, str]]:
    """Plain BPE (Sennrich et al. 2016) over distinct pieces until each is a single symbol.

    Ties between equally frequent pairs break lexicographically, so the result depends only on the word set.
    """
    words = [_symbols(p) for p in pieces if all(c in ALPHABET for c in p)]
    merges: list[tuple[str, str]] = []
    while True:
        counts = Counter(pair for w in words for pair in pairwise(w))
        if not counts:
            return merges
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        words = [_apply(w, best) for w in words]


def _apply(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def build_word_tokenizer(words: Iterable[str], model_max_length: int = 77) -> CLIPTokenizer:
    """A `CLIPTokenizer` whose vocabulary makes every word in `words` a single token (ids are deterministic).

    words: any strings (sentences are fine: they are split like CLIP splits them). Words outside the list still
    encode, character by character; characters outside `ALPHABET` (after lowercasing) become `<|unk|>`.
    model_max_length: the text tower's context (77 for CLIP, 248 after the Long-CLIP stretch).
    Encoding adds bos/eos; pad = eos, as in OpenAI CLIP: `tok(texts, padding="max_length", truncation=True)`.
    """
    merges = _learn_merges(_pieces(words))
    tokens = [UNK, *ALPHABET, *(c + EOW for c in ALPHABET)]
    tokens += [a + b for a, b in merges]
    tokens += [BOS, EOS]
    vocab: dict[str, int] = {}
    for tok in tokens:
        vocab.setdefault(tok, len(vocab))  # a merge can rebuild an alphabet symbol only if it is longer: no clash
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=model_max_length,
    )


def synthdense_tokenizer() -> CLIPTokenizer:
    """The word tokenizer over SynthDense's vocabulary (the tiny presets' with model.vocabulary=synthdense)."""
    return build_word_tokenizer(vocabulary())


def token_counter(fmt: str, tokenizer_path: str | None) -> tuple[Callable[[Sequence[str]], list[int]] | None, str]:
    """For `sharpclip validate-data`: untruncated token counts (bos and eos included) and what counted them, from a
    local HF tokenizer folder, else SynthDense's word tokenizer for format `synthdense`, else (None, "")."""
    if tokenizer_path:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        name = f"tokenizer at {tokenizer_path}"
    elif fmt == "synthdense":
        tokenizer, name = synthdense_tokenizer(), "SynthDense word tokenizer"
    else:
        return None, ""
    return TextTokenizer(tokenizer, context_length=77).lengths, name  # lengths are untruncated: any context will do
