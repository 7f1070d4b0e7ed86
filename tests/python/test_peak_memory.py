"""bench/reports/peak_memory.py on synthetic side_by_side results (CPU, no torch): the peak above the
inputs per run, the held bytes, SonicMoE's column from the run named by --sonic, missing measurements
as '-', and the summary lines."""
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("peak_memory", ROOT / "bench" / "reports" / "peak_memory.py")
pm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pm)

G = 10 ** 9


def doc(commit, configs):
    """configs: {name: (held, peak, base, ms, sonic (peak, base) or None)}."""
    res = []
    for name, (held, peak, base, ms, sonic) in configs.items():
        systems = {"ours": {"held_bytes": held, "peak_bytes": peak, "base_bytes": base, "fwd_bwd_ms": ms},
                   "sonicmoe": ({"peak_bytes": sonic[0], "base_bytes": sonic[1]} if sonic
                                else {"error": "not run (--systems)"})}
        res.append({"config": {"name": name}, "systems": systems})
    return {"commit": commit, "gpu": "H100", "results": res}


def test_columns_and_summaries(tmp_path):
    a = doc("aaa", {"A": (2 * G, 9 * G, 1 * G, 10.0, (6 * G, 1 * G)), "B": (1 * G, 5 * G, 1 * G, 5.0, None)})
    b = doc("bbb", {"A": (2 * G, 7 * G, 1 * G, 9.5, None)})  # B not run: '-'
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    md_path, js_path = tmp_path / "o.md", tmp_path / "o.json"
    pm.main([f"old={pa}", f"new={pb}", "--sonic", "old", "--md", str(md_path), "--json", str(js_path)])
    md = md_path.read_text()
    assert "| A | 2.00 | 8.00 | 6.00 | 5.00 | 10.00 / 9.50 |" in md, md
    assert "| B | 1.00 | 4.00 | - | - | 5.00 / - |" in md, md
    assert "old -> new: the peak falls by 2.00-2.00 GB over 1 configs." in md
    assert "new against SonicMoE's peak: +1.00 to +1.00 GB (1 configs)." in md
    js = json.loads(js_path.read_text())
    assert js["runs"]["old"]["commit"] == "aaa" and js["sonic_from"] == "old"
    row = js["results"][0]
    assert row["config"] == "A" and row["peak_above_base_gb"] == {"old": 8.0, "new": 6.0}
    assert row["sonicmoe_peak_above_base_gb"] == 5.0


def test_unknown_sonic_label_is_refused(tmp_path, capsys):
    p = tmp_path / "a.json"
    p.write_text(json.dumps(doc("aaa", {"A": (G, 2 * G, G, 1.0, None)})))
    try:
        pm.main([f"x={p}", "--sonic", "y"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--sonic y must be refused")
    assert "--sonic 'y'" in capsys.readouterr().err


def test_a_run_embedded_in_an_earlier_report(tmp_path):
    a = doc("aaa", {"A": (G, 4 * G, G, 2.0, None)})
    report = {"kind": "peak_memory", "runs": {"fix": a}}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(report))
    out = tmp_path / "o.md"
    pm.main([f"fix={p}#fix", "--md", str(out)])
    assert "| A | 1.00 | 3.00 | 2.00 |" in out.read_text()
    try:
        pm.main([f"x={p}#nope"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("a missing embedded run must be refused")
