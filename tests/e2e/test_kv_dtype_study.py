"""eval/kv_dtype_study.py end to end on the small embedded model: float32 storage is the
reference (KL 0 against itself), 16-bit storage is compared with it per prompt."""

from __future__ import annotations

import csv


def test_kv_dtype_study_compares_16_bit_storage_with_float32(tmp_path, capsys):
    from eval import kv_dtype_study as mod

    summary = mod.main(["--model", "embedded", "--limit", "1", "--modes", "prefix_subset", "--max-new-tokens", "2",
                        "--out", str(tmp_path)])
    by = {(s["mode"], s["kv_dtype"]): s for s in summary}
    assert set(by) == {(m, d) for m in ("prefix_subset", "all") for d in mod.DTYPES}
    ref = by[("all", "float32")]
    assert ref["prompts"] == 2 and ref["kl_vs_float32_max"] == 0.0 and ref["same_answer"] == 1.0
    for d in ("bfloat16", "float16"):
        assert 0.0 < by[("all", d)]["kl_vs_float32_max"] < 1e-2  # 16-bit storage changes the logits a little
    rows = list(csv.DictReader(open(tmp_path / "kv_dtype.csv")))
    assert len(rows) == 6 and {r["kv_dtype"] for r in rows} == set(mod.DTYPES)
