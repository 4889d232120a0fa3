"""bench table: every row in a process of its own, the same weights and batch, one table and JSON (CPU, tiny)."""
import json
import os
import re
from pathlib import Path

import pytest

from trainstream_hf.bench import table
from trainstream_hf.bench.__main__ import main


def test_rows_run_apart_on_the_same_model_and_make_one_table(tmp_path, capsys):
    main(["table", "--quick", "--peers", "ts_auto,peft,ts_nf4,bnb", "--vram-budget-gib", "0",
          "--out", str(tmp_path), "--name", "t"])
    payload = json.loads((tmp_path / "t.json").read_text())
    rows = {r["row"]: r for r in payload["results"]}
    assert list(rows) == ["ts_auto", "peft", "ts_nf4", "bnb"]
    for name in ("ts_auto", "peft", "ts_nf4"):
        assert rows[name]["status"] == "ok" and rows[name]["step_s"] > 0 and len(rows[name]["losses"]) == 4
    assert rows["bnb"]["status"].startswith("not run")  # not installed here: a row that says so
    # one seeded base for every row: the unquantized rows start from the same loss, bit for bit
    assert rows["ts_auto"]["losses"][0] == rows["peft"]["losses"][0]
    assert "plan" in rows["ts_auto"] and "engine_stats" in rows["ts_auto"]
    shown = {r["row"]: r for r in payload["table"]}
    assert min(r["vs_fastest"] for r in shown.values() if r["vs_fastest"] is not None) == 1.0
    assert shown["trainstream nf4"]["last_loss"] == rows["ts_nf4"]["losses"][-1]
    assert payload["environment"]["commit"] and payload["environment"]["command"].endswith("--name t")
    out = capsys.readouterr().out
    assert "| row | status | step_s |" in out and "bitsandbytes QLoRA nf4 + PEFT | not run" in out
    readme = table.readme_table(str(tmp_path / "t.json"))
    assert readme.count("\n|") >= 5 and "CPU, commit" in readme


def test_a_row_that_hangs_is_a_row_with_that_status():
    payload, md = table.run(shape="tiny", rows=["peft"], seq=16, warmup=1, repeats=1, vram_budget_gib=0,
                            row_timeout=0.5)
    assert payload["results"][0]["status"].startswith("timeout after")
    assert "timeout" in md


def test_unknown_rows_are_named():
    with pytest.raises(ValueError, match=r"unknown row\(s\) \['nope'\]; choose from ts_nvfp4_outliers"):
        table.run(rows=["nope"])


def test_the_readme_table_is_the_committed_json_rendered():
    """The README's results table is generated from a committed JSON, never typed: re-rendering it changes nothing."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "README.md").read_text()
    section = text.split(table.BEGIN)[1].split(table.END)[0].strip()
    path = re.search(r"\(`(benchmarks/results/table-[^`]+\.json)`\)", section).group(1)
    assert (root / path).is_file()
    cwd = os.getcwd()
    os.chdir(root)  # the source line names the JSON relative to the repository
    try:
        assert section == table.readme_table(path)
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("fit_up_to", [5000, 8192, 70000, 300000, 100])
def test_longest_fitting_doubles_then_bisects(fit_up_to):
    best, probes = table.longest_fitting(lambda n: n <= fit_up_to, 1024, 262144, granularity=1024)
    if fit_up_to < 1024:
        assert best is None and probes == [(1024, False)]
        return
    want = min(fit_up_to, 262144) // 1024 * 1024
    assert best == want and all(ok == (n <= fit_up_to) for n, ok in probes)
    assert len(probes) <= 2 * 10  # doublings plus bisection steps, not a scan


def test_longest_runs_each_probe_in_a_child():
    payload, md = table.run_longest(shape="tiny", rows=["peft"], start=16, limit=64, granularity=16,
                                    vram_budget_gib=0)
    r = payload["results"][0]
    assert r["status"] == "ok" and r["longest_seq"] == 64 and [n for n, _ in r["probes"]] == [16, 32, 64]
    assert r["tokens_per_s"] > 0 and "| PyTorch + PEFT, bf16 | ok | 64 |" in md
