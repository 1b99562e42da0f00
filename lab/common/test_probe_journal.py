"""lab/common/probe_journal.py: the H200 probes' shared log stamp and JSON dump (the probes themselves only
run on the device)."""

import json
import re

import torch
from lab.common import probe_journal as mod

def test_log_is_stamped_with_seconds_since_start(tmp_path, capsys):
    journal = mod.ProbeJournal(str(tmp_path), "p.json", {}, t0=mod.time.time() - 12.5)
    journal.log("case", 7)
    line = capsys.readouterr().out.strip()
    m = re.fullmatch(r"\[\s*(\d+\.\d)s\] case 7", line)
    assert m is not None, line
    assert 12.5 <= float(m.group(1)) < 20.0


def test_dump_writes_the_current_record_and_prints_what_json_cannot_hold_as_text(tmp_path):
    record = {"cases": [], "errors": []}
    journal = mod.ProbeJournal(str(tmp_path / "new"), "p.json", record)
    journal.dump()
    assert json.loads((tmp_path / "new" / "p.json").read_text()) == {"cases": [], "errors": []}
    value = torch.randn(()).item()
    record["cases"].append({"dtype": torch.float8_e4m3fn, "shape": torch.Size([3, 5]), "v": value})
    journal.dump()  # the probe keeps filling the same dict; each dump writes what it holds now
    got = json.loads((tmp_path / "new" / "p.json").read_text())
    assert got["cases"] == [{"dtype": "torch.float8_e4m3fn", "shape": [3, 5], "v": value}]


def test_guard_records_results_errors_and_the_deadline(tmp_path):
    record = {"errors": []}
    journal = mod.ProbeJournal(str(tmp_path), "p.json", record)
    assert journal.guard("ok", 60.0, key="ok")(lambda x: {"twice": 2 * x})(21) == {"twice": 42}
    assert journal.guard("bad", 60.0)(lambda: 1 / 0)() is None  # recorded, not raised
    late = mod.ProbeJournal(str(tmp_path), "q.json", {"errors": []}, t0=mod.time.time() - 100)
    assert late.guard("late", 10.0, key="late")(lambda: 1)() is None
    got = json.loads((tmp_path / "p.json").read_text())
    assert got["ok"] == {"twice": 42} and set(got["seconds"]) == {"ok"}
    assert [e["what"] for e in got["errors"]] == ["bad"] and "ZeroDivisionError" in got["errors"][0]["error"]
    assert late.data["errors"] == [{"what": "late", "error": "skipped: deadline"}] and "late" not in late.data


def test_relaunches_compare_each_input_with_its_own_first_output():
    """The relaunch counter of the race probe and the matrix (megamoe.testing.Relaunches): with two inputs
    alternating, each output is compared with its own input's first output, bit for bit, and the most changed
    rows are kept."""
    from megamoe.testing import Relaunches

    torch.manual_seed(5)
    a, b = torch.randn(6, 16).bfloat16(), torch.randn(6, 16).bfloat16()
    seen = Relaunches()
    for j, y in ((0, a), (1, b), (0, a.clone()), (1, b.clone())):
        seen.add(y, j)
    assert (seen.changed, seen.max_rows) == (0, 0)  # equal bits, other tensors: no difference
    two_rows = a.clone()
    two_rows[[1, 4], 3] += 1
    assert seen.add(two_rows, 0).tolist() == [False, True, False, False, True, False]
    seen.add(a, 1)  # input 1's first output is b: a differs from it in (almost surely) every row
    assert seen.changed == 2 and seen.max_rows == int((a.view(torch.int16) != b.view(torch.int16)).any(1).sum())
    assert seen.max_rows >= 2
