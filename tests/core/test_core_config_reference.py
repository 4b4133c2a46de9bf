"""Every config key is documented where users look: docs/config.md (generated from config.py's field comments) and
`sharpclip config --explain KEY`. Fails when a key has no description or the page is stale."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from sharpclip.config import ConfigError, load_config, to_yaml
from sharpclip.config_reference import (
    REGENERATE,
    _generic,
    all_keys,
    explain,
    field_comments,
    markdown,
    undocumented,
)

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "config.md"


def test_every_key_has_a_description_and_every_section_a_docstring() -> None:
    missing = undocumented()
    assert not missing, f"describe these in src/sharpclip/config.py (a comment beside the field): {missing}"


def test_the_reference_page_is_the_generated_one_and_in_the_site() -> None:
    assert PAGE.read_text(encoding="utf-8") == markdown(), f"docs/config.md is stale: regenerate it with `{REGENERATE}`"
    assert "Configuration reference: config.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out += _leaves(value, name) if isinstance(value, dict) and value else [name]
    return out


def test_every_key_sharpclip_config_prints_is_on_the_page() -> None:
    """The keys of the resolved default config (what `sharpclip config` prints, the default loss term included)."""
    printed = _leaves(yaml.safe_load(to_yaml(load_config())))
    names = {k.name for k in all_keys()}
    assert len(printed) >= 140
    assert [p for p in printed if _generic(p, names) not in names] == []
    page = PAGE.read_text(encoding="utf-8")
    assert [n for n in names if f"`{n}`" not in page] == []


def test_descriptions_come_from_the_comment_beside_or_above_a_field() -> None:
    source = textwrap.dedent(
        '''
        @dataclass
        class Part:
            """A part."""

            beside: int = 1  # what beside does
            # what above does,
            # over two lines
            above: str = "x"
            bare: float = 0.5
            pragma: list[int] = field(default_factory=list)  # fmt: skip

            long: dict[str, int] = field(
                default_factory=dict
            )  # the comment on a field's last line
        '''
    )
    assert field_comments(source) == {
        ("Part", "beside"): "what beside does",
        ("Part", "above"): "what above does, over two lines",
        ("Part", "long"): "the comment on a field's last line",
    }


def test_config_explain_prints_a_key_a_prefix_and_names_the_closest_for_a_typo(capsys) -> None:
    from sharpclip.cli import main

    assert main(["config", "--explain", "train.lr"]) == 0
    assert capsys.readouterr().out.startswith("train.lr (float, default 1e-05): ")
    assert main(["config", "--explain", "data.augment"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all(line.startswith("data.augment.") for line in lines)
    assert main(["config", "--explain", "loss.terms.hn.params"]) == 0  # a term's own name stands for <name>
    assert capsys.readouterr().out.startswith("loss.terms.<name>.params (dict[str, Any], default {}): ")
    with pytest.raises(ConfigError, match=r"--explain train.batchsize: no such key; did you mean train.batch_size"):
        explain("train.batchsize")  # the CLI prints it as its one-line config error


def test_config_explain_knows_other_tools_names_as_the_overrides_do(capsys) -> None:
    from sharpclip.cli import main

    assert main(["config", "--explain", "train.learning_rate"]) == 0  # transformers' name
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "train.learning_rate is called train.lr here:" and lines[1].startswith("train.lr (float")
    assert main(["config", "--explain", "train.wd"]) == 0  # open_clip's name
    assert capsys.readouterr().out.splitlines()[1].startswith("train.weight_decay (float, default 0.1)")
    with pytest.raises(ConfigError, match=r"did you mean train.lr"):
        explain("train.lerning_rate")  # a typo of another tool's name still finds the key


def test_config_explain_num_workers_says_what_the_code_does() -> None:
    text = explain("data.num_workers")
    assert "at most 8" not in text and "no fixed cap" in text and "quota" in text


def test_train_help_points_to_config_explain(capsys) -> None:
    from sharpclip.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "sharpclip config --explain KEY" in out and "docs/config.md" in out
