"""The README's tables are what the committed results say (tools/readme_tables.py regenerates them)."""
import os
import sys

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import readme_tables  # noqa: E402


def test_readme_tables_match_the_committed_results():
    with open(readme_tables.README, encoding="utf-8") as f:
        text = f.read()
    assert readme_tables.MARKER.search(text), "the README has no generated tables"
    assert readme_tables.render(text) == text, "README.md is stale: run python tools/readme_tables.py"


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
    with open(readme_tables.README, encoding="utf-8") as f:
        text = f.read()
    assert readme_tables.render(text) != text
