"""eval/decode_step.py --cuda-graphs on a CPU: the engine's decode steps run the static step uncaptured."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_step_with_cuda_graphs_runs_the_static_step_and_counts_the_calls_inside_it(tmp_path):
    # a child process: the flag turns the native attention kernel off for the process it runs in
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "eval.decode_step", "--quick", "--cuda-graphs", "--device", "cpu",
                          "--steps", "2", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    with (tmp_path / "decode_step.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["batch"]) for r in rows] == [1, 4]
    for r in rows:
        assert r["cuda_graphs"] == "True" and int(r["static_steps"]) == 1 and int(r["replayed"]) == 0
        # the forward over the buffers: most of the step's aten calls, none of the scheduler's around it
        assert 0 < int(r["static_aten"]) < int(r["aten_calls"])
        # the step's time outside its static forward: some, less than the step (the forward is most of it)
        assert 0 < float(r["outside_ms_min"]) <= float(r["outside_ms"]) < float(r["step_ms"])
    assert "aten in static" in run.stdout and "outside ms" in run.stdout
