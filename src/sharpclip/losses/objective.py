"""The training objective: a weighted sum of named loss terms, each a registered pure loss.

    HN-CLIP eq. 3:  L = L_HN + λ·L_tok                                   terms: hn_clip, filip
    CLIP-IN eq. 8:  L = λ_short·L_CL(short) + λ_long·L_CL(long) + λ_HN·L_HN
                    terms: infonce {text: text_short}, infonce {text: text_long}, edit_negatives

A term reads its tensor inputs from one mapping of features (the global batch after gathering and accumulation,
plus the model's `logit_scale` / `logit_bias`). Each loss argument is read from the feature of the same name unless
the term's `inputs` remaps it, which is how one loss serves the short and the long captions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from sharpclip.config import ConfigError, LossConfig
from sharpclip.losses import registry

MODEL_INPUTS = frozenset({"logit_scale", "logit_bias"})  # supplied by the model, not per-sample features


@dataclass(frozen=True)
class Term:
    name: str
    spec: registry.LossSpec
    weight: float
    params: dict[str, Any]
    inputs: dict[str, str]  # every tensor argument of the loss -> feature key

    def __call__(self, features: Mapping[str, Tensor]) -> Tensor:
        kwargs = dict(self.params)
        for arg, key in self.inputs.items():
            if key in features and features[key] is not None:
                kwargs[arg] = features[key]
            elif arg in self.spec.inputs:
                raise KeyError(
                    f"loss term '{self.name}' ({self.spec.name}) needs feature '{key}' for its argument '{arg}', "
                    f"but the batch has only: {', '.join(sorted(features))}"
                )
        return self.spec.fn(**kwargs)


class Objective:
    """Σ weight·term over named terms; returns {"loss": total, <term>: value, ...} (values keep their graph).

    Terms of weight 0 are skipped, neither computed nor returned.
    """

    def __init__(self, terms: list[Term]):
        if not terms:
            raise ConfigError("loss.terms: the objective has no terms")
        self.terms = terms

    def __call__(self, features: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        total: Tensor | float = 0.0
        for term in self.terms:
            if term.weight == 0:  # disabled (e.g. `loss.terms.tok.weight=0` on the command line): not computed
                continue
            value = term(features)
            out[term.name] = value
            total = total + term.weight * value
        out["loss"] = total  # type: ignore[assignment]
        return out

    @property
    def feature_keys(self) -> set[str]:
        """Per-sample features the terms read (what the model must encode), model parameters excluded."""
        return {key for t in self.terms for key in t.inputs.values()} - MODEL_INPUTS

    def __repr__(self) -> str:
        return " + ".join(f"{t.weight:g}·{t.name}[{t.spec.name}]" for t in self.terms)


def _build_term(name: str, loss: str, weight: float, params: Mapping[str, Any], inputs: Mapping[str, str]) -> Term:
    where = f"loss.terms.{name}"
    try:
        spec = registry.get(loss)
    except KeyError as err:
        raise ConfigError(f"{where}.loss: {err.args[0]}") from None
    for key in params:
        if key not in spec.params:
            known = ", ".join(spec.params) or "none"
            raise ConfigError(f"{where}.params.{key}: '{loss}' has no such parameter; it takes: {known}")
    arguments = spec.inputs + spec.optional_inputs
    for arg in inputs:
        if arg not in arguments:
            known = ", ".join(arguments)
            raise ConfigError(f"{where}.inputs.{arg}: '{loss}' has no such input; its inputs are: {known}")
    mapping = {arg: inputs.get(arg, arg) for arg in arguments}
    return Term(name, spec, float(weight), dict(params), mapping)


def build_objective(cfg: LossConfig) -> Objective:
    """The objective described by `cfg.terms`, validated against the registry (names, params, inputs)."""
    return Objective([_build_term(n, t.loss, t.weight, t.params, t.inputs) for n, t in cfg.terms.items()])
