"""tools/calibrate.py's LATTE flags come from LatteConfig: one flag per field, and each changes the config."""
import dataclasses
import os

import pytest

from latte_plugin.calibration.config import LatteConfig

from latte_plugin.cli import calibrate as tool

#: a command-line value different from the default, per field
VALUES = {"candidates": ["a.*.attn", "b.attn"], "ratio": "0.5", "num_linear": "3", "variant": "qtvit",
          "num_images": "7", "max_items": "9", "max_queries": "11", "steps": "3", "lr": "0.5", "correction": "sigma",
          "refit_reg": ["0.5", "2"], "correction_rules": ["sigma", "diag"], "holdout": "0.5", "per_head": None, "signal": "--no-signal", "sequential": None, "compensate": "never", "judge": "detections", "search": "matched", "selection": "score",
          "lam": "2.5", "greedy_images": "4", "final_set": "search", "mode": "dynamic", "threshold": "64", "seed": "5", "target": "0.01", "backend": "eager",
          "kernel": "piecewise", "piecewise_top": "2", "piecewise_block": "32", "piecewise_order": "tokens",
          "piecewise_rest": "blockmean", "speedup": "1.2", "cost_model": "cost.json", "reference": "paper",
          "choose_for": ["speed", "--target", "0.05"],  # speed needs a speed-up or a budget
          "input_size": ["1024"]}


def _flag(name):
    return "--" + name.replace("_", "-")


def test_every_config_field_is_a_flag_and_every_flag_changes_the_config():
    fields = [f.name for f in dataclasses.fields(LatteConfig) if f.name not in tool.NOT_FLAGS]
    assert set(VALUES) == set(fields), "a LatteConfig field without a test value: add it to VALUES"
    base = LatteConfig().to_dict()
    for name in fields:
        value = VALUES[name]
        argv = ["cfg.py", _flag(name)] + ([] if value is None else value if isinstance(value, list) else [value])
        overrides = tool.latte_overrides(tool.parse_args(argv))
        changed = LatteConfig.from_dict({**base, **overrides}).to_dict()
        assert changed[name] != base[name], (name, overrides)


def test_boolean_flags_turn_off_too_and_unset_flags_change_nothing():
    assert tool.latte_overrides(tool.parse_args(["cfg.py"])) == {}
    assert tool.latte_overrides(tool.parse_args(["cfg.py", "--no-sequential"])) == {"sequential": False}
    assert tool.latte_overrides(tool.parse_args(["cfg.py", "--correction", "none"])) == {"correction": "none"}


def test_input_size_takes_one_side_or_two_and_refuses_the_rest():
    """``--input-size 1024`` is a square, ``--input-size 800 1333`` height then width; the config
    keeps (height, width) and writes a list; anything but one or two positive pixel counts is refused."""
    assert tool.latte_overrides(tool.parse_args(["cfg.py", "--input-size", "1024"])) == {"input_size": [1024]}
    assert LatteConfig(input_size=[1024]).input_size == (1024, 1024)
    assert LatteConfig(input_size=(800, 1333)).to_dict()["input_size"] == [800, 1333]
    assert LatteConfig.from_dict(LatteConfig(input_size=640).to_dict()) == LatteConfig(input_size=640)
    for bad in ([0], [1, 2, 3], [12.5], []):
        with pytest.raises(ValueError, match="input_size must be one or two positive pixel counts"):
            LatteConfig(input_size=bad)


def test_help_comes_from_the_fields_metadata():
    helps = LatteConfig.field_help()
    assert set(helps) == {f.name for f in dataclasses.fields(LatteConfig)}
    assert all(helps.values()), [n for n, h in helps.items() if not h]  # no field without its help
    assert helps["correction"].startswith("output correction") and "refit" in helps["correction"]
    text = tool.parse_args.__globals__["argparse"].ArgumentParser()
    tool.add_latte_arguments(text)
    rendered = text.format_help()  # argparse %-formats help: a '%' in a help text must not break it
    for name, h in helps.items():
        if name not in tool.NOT_FLAGS:
            assert " ".join(h.split()[:3]) in " ".join(rendered.split()), name
    with pytest.raises(SystemExit):
        tool.parse_args(["cfg.py", "--correction", "diagonal"])
    with pytest.raises(SystemExit):  # ratio and num_linear exclude each other
        tool.parse_args(["cfg.py", "--ratio", "0.5", "--num-linear", "2"])


def test_a_percent_sign_in_a_help_text_does_not_break_help(monkeypatch):
    """The cause of the old crash: argparse read a '%' of the help text as a format directive."""
    import argparse

    f = next(f for f in dataclasses.fields(LatteConfig) if f.name == "lam")
    monkeypatch.setattr(f, "metadata", {"help": "keeps 95% (a percent sign)"})
    p = argparse.ArgumentParser()
    tool.add_latte_arguments(p)
    assert "keeps 95% (a percent sign)" in p.format_help()


@pytest.mark.parametrize("value,match", [("1.5", "target"), ("0", "target"), ("-0.1", "target")])
def test_a_target_outside_0_1_is_refused_with_the_range(value, match):
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
        LatteConfig.from_dict({"target": float(value)})


@pytest.mark.parametrize("name", ["max_items", "max_queries", "num_images", "greedy_images"])
def test_counts_below_one_name_the_setting(name):
    with pytest.raises(ValueError, match=f"{name} must be >= 1"):
        LatteConfig.from_dict({name: 0})


@pytest.mark.parametrize("argv,match", [(["--target", "1.5"], r"target .* must be in \(0, 1\), got 1.5"),
                                        (["--max-items", "0"], "max_items must be >= 1, got 0")])
def test_the_tool_refuses_a_bad_setting_in_one_line_before_building_anything(tmp_path, argv, match):
    import re

    with pytest.raises(SystemExit) as exc:
        tool.main([str(tmp_path / "no_such_config.py"), "--work-dir", str(tmp_path / "w")] + argv)
    msg = str(exc.value)
    assert re.search(match, msg) and "\n" not in msg and msg.startswith("error: ")
    assert not os.path.exists(tmp_path / "w")
