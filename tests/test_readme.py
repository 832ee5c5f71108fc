"""The README's tables are what the committed results say (experiments/readme_tables.py regenerates them)."""
import os

from tests.conftest import ROOT

from experiments import readme_tables


def test_readme_tables_match_the_committed_results():
    """Every generated table, on the README and on every docs/ page."""
    found = 0
    for page in readme_tables.pages():
        with open(page, encoding="utf-8") as f:
            text = f.read()
        found += len(readme_tables.MARKER.findall(text))
        assert readme_tables.render(text) == text, f"{page} is stale: run python -m experiments.readme_tables"
    assert found >= 10, "the pages have lost their generated tables"
    with open(readme_tables.README, encoding="utf-8") as f:
        assert "<!-- results:headline -->" in f.read(), "the README's headline table is not generated"


def test_the_readme_is_a_front_door_and_nothing_points_outside_the_repository():
    import subprocess

    with open(readme_tables.README, encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 250
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    outside = []
    for name in files:
        if name.endswith((".py", ".md", ".sh", ".json", ".txt", ".ini", ".toml", ".cfg")):
            with open(os.path.join(ROOT, name), encoding="utf-8", errors="replace") as f:
                if "../" + "shared" in f.read():  # (spelled apart so this file does not match itself)
                    outside.append(name)
    assert not outside, f"files that point outside the repository: {outside}"


def test_a_changed_result_makes_the_check_fail(tmp_path, monkeypatch):
    import json
    import shutil

    results = tmp_path / "results"
    shutil.copytree(readme_tables.RESULTS, results)
    path = results / "detector_cpu.json"
    data = json.loads(path.read_text())
    data["rows"][0]["enc_speedup"] += 1.0
    path.write_text(json.dumps(data))
    monkeypatch.setattr(readme_tables, "RESULTS", str(results))
    changed = []
    for page in readme_tables.pages():
        with open(page, encoding="utf-8") as f:
            text = f.read()
        if readme_tables.render(text) != text:
            changed.append(os.path.basename(page))
    assert changed == ["deployment.md"]  # the page that holds the detector timing table


def test_the_cost_table_takes_the_median_over_rounds_and_the_ratios_range_within_them(tmp_path, monkeypatch):
    import json

    rows = [{"model": "m", "setting": s, "repeat": r, "num_images": 32, "seconds": sec}
            for s, secs in (("defaults", (20.0, 30.0, 22.0)), ("previous defaults", (10.0, 12.0, 11.0)))
            for r, sec in enumerate(secs)]
    (tmp_path / "defaults_cost.json").write_text(json.dumps({"rows": rows, "command": "c", "threads": "1"}))
    monkeypatch.setattr(readme_tables, "RESULTS", str(tmp_path))
    table = readme_tables.defaults_cost_table()
    # medians 22 / 11; per round 2.00, 2.50, 2.00
    assert "| m | 32 | 22 s | 11 s | 2.00x (2.00-2.50) |" in table
    assert "median of 3 rounds" in table
