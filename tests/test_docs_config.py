"""docs/config.md is generated from the config definition (scripts/gen_config_docs.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import ml_collections
import pytest

from fusedattn import configs
from fusedattn.ops import enums

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
gen_config_docs = importlib.util.module_from_spec(_spec)
sys.modules["gen_config_docs"] = gen_config_docs
_spec.loader.exec_module(gen_config_docs)

REGENERATE = "run `python scripts/gen_config_docs.py` and commit docs/config.md"


def test_every_config_key_has_a_description():
    missing = sorted(set(gen_config_docs.leaf_defaults(configs.attention_config()))
                     - set(gen_config_docs.DESCRIPTIONS))
    assert not missing, (f"config key(s) without a description: {missing}: add them to "
                         f"DESCRIPTIONS in scripts/gen_config_docs.py, then {REGENERATE}")


def test_the_committed_page_is_what_the_generator_writes_now():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == gen_config_docs.render(), f"docs/config.md is out of date: {REGENERATE}"


def test_each_key_is_one_row_with_its_default_and_its_enum_values():
    config = configs.attention_config()
    defaults = gen_config_docs.leaf_defaults(config)
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")
            for line in gen_config_docs.render(config).splitlines()
            if line.startswith("| ") and not line.startswith("| key ")}
    assert set(rows) == set(defaults)
    assert rows["backend"][1] == '"auto"' and rows["window_size"][1] == "(-1, -1)"
    assert rows["scale"][1] == "None" and rows["sequence.max_segments_per_seq"][1] == "1"
    for key, enum in gen_config_docs.ENUMS.items():
        assert rows[key][2] == ", ".join(f'"{m.value}"' for m in enum)
        enum.parse(defaults[key], key)  # the default is one of the listed values


def test_string_keys_with_an_enum_are_mapped_to_it():
    """A str key whose default is a value of an enum of fusedattn/ops/enums.py lists that enum's
    values (ENUMS), not a hand-written copy."""
    choices = [cls for cls in vars(enums).values()
               if isinstance(cls, type) and issubclass(cls, enums._Choice) and cls is not enums._Choice]
    for key, default in gen_config_docs.leaf_defaults(configs.attention_config()).items():
        owners = [cls.__name__ for cls in choices if default in {m.value for m in cls}]
        if isinstance(default, str) and owners:
            assert key in gen_config_docs.ENUMS, (
                f"config key {key!r} takes the values of {owners}: map it in ENUMS of "
                f"scripts/gen_config_docs.py (and set its DESCRIPTIONS values to None), then {REGENERATE}")


def _config_with(section: str, **leaves) -> ml_collections.ConfigDict:
    config = configs.attention_config()
    config.unlock()
    config[section] = ml_collections.ConfigDict(leaves)
    return config


def test_a_new_key_without_a_description_fails_naming_it():
    config = _config_with("newsection", knob=3)
    with pytest.raises(ValueError, match=r"newsection\.knob.*DESCRIPTIONS in scripts/gen_config_docs.py"):
        gen_config_docs.render(config)


def test_described_keys_appear_only_when_the_config_has_them():
    config = configs.attention_config()
    defaults = gen_config_docs.leaf_defaults(config)
    page = gen_config_docs.render(config)
    for key in gen_config_docs.DESCRIPTIONS:
        assert (f"| {key} |" in page) == (key in defaults), key
    page = gen_config_docs.render(_config_with("fp8", enabled=False, format="e4m3", scaling="delayed",
                                               amax_history_len=16, margin=0))
    assert '| fp8.format | "e4m3" | "e4m3", "hybrid" |' in page
    assert "| fp8.margin | 0 | int >= 0 | scale = fp8_max / amax / 2^margin |" in page


def test_check_mode_reports_a_stale_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "config.md"
    page.write_text("stale\n")
    monkeypatch.setattr(gen_config_docs, "PAGE", page)
    monkeypatch.setattr(gen_config_docs, "ROOT", tmp_path)
    assert gen_config_docs.main(["--check"]) == 1
    assert "config.md is out of date: run python scripts/gen_config_docs.py" in capsys.readouterr().err
    assert gen_config_docs.main([]) == 0
    assert gen_config_docs.main(["--check"]) == 0
