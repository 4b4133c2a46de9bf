"""The training objective: a weighted sum of named loss terms, each a registered pure loss.

    HN-CLIP eq. 3:  L = L_HN + λ·L_tok                                   terms: hn_clip, filip
    CLIP-IN eq. 8:  L = λ_short·L_CL(short) + λ_long·L_CL(long) + λ_HN·L_HN
                    terms: infonce {text: text_short}, infonce (text: the long caption), edit_negatives

A term reads its tensor inputs from one mapping of features (the global batch after gathering and accumulation,
plus the model's `logit_scale` / `logit_bias`). Each loss argument is read from the feature of the same name unless
the term's `inputs` remaps it, which is how one loss serves the short and the long captions. The names that exist
are the caller's feature table (train.features), handed to `build_objective`: a required argument or a remapped one
that names no feature is a config error naming `loss.terms.<term>.inputs.<arg>`; an optional argument whose own
name is no feature (`reference_text` of hn_clip) keeps its default. Hyperparameters (`params`) are checked against
the loss's keyword-only parameters, by name and by their annotated type.

Diagnostic terms (losses.monitors) have weight 0: `Objective.__call__` skips them like any weight-0 term, and
`Objective.diagnose` evaluates them, without a gradient, on the same features.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from sharpclip.config import ConfigError, LossConfig, TermConfig
from sharpclip.losses import registry
from sharpclip.losses._common import check_hyperparameters, hyperparameter_problem
from sharpclip.losses.monitors import infonce_saturation

SATURATION_TERM = "infonce_saturation"  # the diagnostic term of image-caption objectives (losses.monitors)


@dataclass(frozen=True)
class Term:
    name: str
    spec: registry.LossSpec
    weight: float
    params: dict[str, Any]
    inputs: dict[str, str]  # every bound tensor argument of the loss -> feature key
    diagnostic: bool = False  # weight 0, evaluated by `Objective.diagnose` only
    remapped: frozenset[str] = frozenset()  # arguments the config mapped: they must be there at call time

    def __post_init__(self) -> None:  # built by hand too: the same ranges as a config's terms
        check_hyperparameters(f"Term {self.name!r}", weight=self.weight, **self.params)

    def __call__(self, features: Mapping[str, Tensor]) -> Any:
        kwargs = dict(self.params)
        for arg, key in self.inputs.items():
            if key in features and features[key] is not None:
                kwargs[arg] = features[key]
            elif arg in self.spec.inputs or (arg in self.remapped and key not in features):
                raise KeyError(
                    f"loss term '{self.name}' ({self.spec.name}) needs feature '{key}' for its argument '{arg}', "
                    f"but the batch has only: {', '.join(sorted(features))}"
                )
        return self.spec.fn(**kwargs)

    @property
    def computed(self) -> bool:
        """Whether the step evaluates this term (a weight-0 loss term is disabled; a diagnostic term is not)."""
        return self.weight != 0 or self.diagnostic


class Objective:
    """Σ weight·term over named terms; returns {"loss": total, <term>: value, ...} (values keep their graph).

    Terms of weight 0 are skipped, neither computed nor returned; diagnostic terms (weight 0) are evaluated by
    `diagnose`.
    """

    def __init__(self, terms: list[Term]):
        if not any(not t.diagnostic for t in terms):
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
    def per_sample(self) -> bool:
        """Whether every computed term is a mean over rows of a per-row value (registry's `per_sample`): the
        objective of a micro-batch split into equal parts is then the mean of the parts' objectives."""
        return all(t.spec.per_sample for t in self.terms if not t.diagnostic and t.weight != 0)

    def diagnose(self, features: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The diagnostic terms' values on `features` (no gradient), flattened: {name: 0-dim tensor}. They stay on
        the features' device, so that evaluating them between forward and backward waits for nothing."""
        out: dict[str, Tensor] = {}
        for term in self.terms:
            if term.diagnostic:
                out.update({k: v.detach() for k, v in term(features).items()})
        return out

    def bindings(self) -> Iterator[tuple[str, str, str]]:
        """(term, argument, feature) for every bound input of every computed term."""
        for term in self.terms:
            if term.computed:
                yield from ((term.name, arg, key) for arg, key in term.inputs.items())

    @property
    def feature_keys(self) -> set[str]:
        """Every feature the computed terms read (what the feature encoder must produce, model parameters too)."""
        return {key for _, _, key in self.bindings()}

    def param_of(self, loss: str, name: str) -> Any:
        """Hyperparameter `name` of the first weighted `loss` term, else that loss's default (γ of hn_clip for the
        gradient diagnostics: the configured one)."""
        for term in self.terms:
            if term.spec.name == loss and term.weight != 0:
                return term.params.get(name, term.spec.params[name])
        return registry.get(loss).params[name]

    def __repr__(self) -> str:
        """`1·hn[hn_clip gamma=0.5] + 1·tok[filip]`: every term that the loss sums, with its set parameters."""
        return " + ".join(
            f"{t.weight:g}·{t.name}[{' '.join([t.spec.name, *(f'{k}={v!r}' for k, v in t.params.items())])}]"
            for t in self.terms if not t.diagnostic
        )  # fmt: skip


def _type_name(hint: Any) -> str:
    return " or ".join("None" if a is type(None) else getattr(a, "__name__", str(a)) for a in _alternatives(hint))


def _alternatives(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _typed(where: str, value: Any, hint: Any) -> Any:
    """`value` as the annotation `hint` wants it (an int where a float is wanted becomes a float), else an error."""
    allowed = _alternatives(hint)
    if hint is Any or (value is None and type(None) in allowed):
        return value
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if float in allowed and is_number:
        return float(value)
    if any(isinstance(value, a) and not (isinstance(value, bool) and a is int) for a in allowed if isinstance(a, type)):
        return value
    raise ConfigError(f"{where}: expected {_type_name(hint)}, got {value!r} ({type(value).__name__})")


def _bind(where: str, spec: registry.LossSpec, inputs: Mapping[str, str], features: Collection[str]) -> dict:
    """Loss argument -> feature for every argument that has one; unknown names are errors naming the key."""
    arguments = spec.inputs + spec.optional_inputs
    for arg in inputs:
        if arg not in arguments:
            raise ConfigError(f"{where}.{arg}: '{spec.name}' has no such input; its inputs are: {', '.join(arguments)}")
    mapping = {}
    for arg in arguments:
        key = inputs.get(arg, arg)
        if key in features:
            mapping[arg] = key
        elif arg in inputs or arg in spec.inputs:
            said = f"'{key}' is no feature" if arg in inputs else f"'{spec.name}' reads '{arg}', which is no feature"
            raise ConfigError(f"{where}.{arg}: {said}; the features are: {', '.join(features)}")
    return mapping


def _build_term(name: str, cfg: TermConfig, features: Collection[str]) -> Term:
    where = f"loss.terms.{name}"
    try:
        spec = registry.get(cfg.loss)
    except KeyError as err:
        raise ConfigError(f"{where}.loss: {err.args[0]}") from None
    params = {}
    for key, value in cfg.params.items():
        if key not in spec.params:
            known = ", ".join(spec.params) or "none"
            raise ConfigError(
                f"{where}.params.{key}: '{cfg.loss}' has no such parameter; it takes: {known} (a parameter of the "
                f"term's earlier loss? replace the whole term, {where}:={{loss: {cfg.loss}}}, or delete the "
                f"parameter, ~{where}.params.{key})"
            )
        params[key] = _typed(f"{where}.params.{key}", value, spec.param_types[key])
    _check_values(where, cfg.weight, params)
    mapping = _bind(f"{where}.inputs", spec, cfg.inputs, features)
    remapped = frozenset(cfg.inputs) - {registry.ROWS}  # a slice given on several processes only
    return Term(name, spec, float(cfg.weight), params, mapping, remapped=remapped)


def _check_values(where: str, weight: Any, params: Mapping[str, Any]) -> None:
    """A term's weight and parameters within losses._common.HYPERPARAMETER_FLOOR's ranges (finite, >= the floor)."""
    checked = {"weight": (f"{where}.weight", weight), **{k: (f"{where}.params.{k}", v) for k, v in params.items()}}
    for name, (key, value) in checked.items():
        if (problem := hyperparameter_problem(name, value)) is not None:
            raise ConfigError(f"{key}: {problem}, got {value!r}")


def _saturation_term(features: Collection[str]) -> Term:
    spec = registry.spec_of(SATURATION_TERM, infonce_saturation)
    return Term(SATURATION_TERM, spec, 0.0, {}, _bind("loss.monitor", spec, {}, features), diagnostic=True)


def build_objective(cfg: LossConfig, features: Collection[str], monitor: bool = False) -> Objective:
    """The objective described by `cfg.terms`, validated against the registry (names, typed params) and against
    `features`, the names of the feature table (train.features.FEATURES); `monitor` adds the InfoNCE saturation
    diagnostic (weight 0), which reads image, text and logit_scale."""
    terms = [_build_term(n, t, features) for n, t in cfg.terms.items()]
    if monitor:
        if SATURATION_TERM in cfg.terms:
            raise ConfigError(f"loss.terms.{SATURATION_TERM}: the name is taken by the saturation diagnostic")
        terms.append(_saturation_term(features))
    return Objective(terms)
