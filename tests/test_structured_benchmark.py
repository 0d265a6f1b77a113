"""benchmarks/structured.py's host-only section on the CPU: the token masks of grammar-bound rows, one thread and
more, on the embedded vocabulary and the GPU checkpoint's word-level one, written to structured.json beside what
the GPU section wrote there."""
import json
import subprocess
import sys


def test_the_masks_section_times_every_case_and_keeps_the_decode_rows(tmp_path):
    (tmp_path / "structured.json").write_text(json.dumps({"rows": [{"batch": 1, "mode": "free"}]}))
    done = subprocess.run([sys.executable, "benchmarks/structured.py", "--sections", "masks", "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "structured.json").read_text())
    cells = result["masks"]["rows"]
    assert {c["case"] for c in cells} == {"embedded 4096, JSON schema", "word-level 151936, regex"}
    assert {c["threads"] for c in cells} >= {1, 2} and {c["rows"] for c in cells} == {1, 4}
    assert all(c["ms_per_step"] > 0 for c in cells) and result["rows"] == [{"batch": 1, "mode": "free"}]
    assert (tmp_path / "structured_masks.png").stat().st_size
