"""Stored bytes with and without window-aware storage (``StoreConfig.window_aware``).

    python -m eval.window_storage [--model gemma3-270m] [--tokens 256 512 1024 2048 4096 8192]
                                  [--dtype float32] [--out eval/results]

For each length n: a document of n tokens encoded on the model (its real states, at position 0),
then written through the codec twice, whole and with the model's sliding windows (what the disk
and Redis tiers write with the option: sliding layers keep the last ``window`` tokens), and read
back (the trimmed state must read back as the whole one in every kept entry). Writes
window_storage.csv and window_storage.png: bytes of both, and the share saved.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .common import RESULTS, add_model_args, pyplot, save_figure, save_table, text_of_tokens


def measure(pc, n: int) -> dict:
    from promptcache.store import codec
    from promptcache.store.codec import kept_tokens

    windows = pc.adapter.sliding_windows()
    ids = pc.tokenizer(text_of_tokens(pc.tokenizer, n, seed=n), add_special_tokens=False).input_ids[:n]
    kv = pc.encode_span(ids, 0)
    whole, _ = codec.encode({"kv": ("doc", kv)})
    trimmed, _ = codec.encode({"kv": ("doc", kv)}, windows=windows)
    back = codec.decode(trimmed, "kv", codec.StateInfo("doc"))
    t = kept_tokens(windows, len(ids))
    if t is not None:  # every kept entry as stored whole
        for layer, k in enumerate(t.kept):
            assert torch.equal(back[layer, :, :, len(ids) - k:], kv[layer, :, :, len(ids) - k:].cpu())
    return {"tokens": len(ids), "layers": kv.shape[0],
            "sliding_layers": sum(w is not None for w in windows or []),
            "window": min((w for w in windows or [] if w), default=0),
            "bytes_whole": len(whole), "bytes_window_aware": len(trimmed),
            "saved": round(1 - len(trimmed) / len(whole), 4)}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    n = [r["tokens"] for r in rows]
    ax.plot(n, [r["bytes_whole"] / 2**20 for r in rows], "o-", label="whole")
    ax.plot(n, [r["bytes_window_aware"] / 2**20 for r in rows], "s-", label="window-aware")
    for r in rows:
        ax.annotate(f"-{r['saved']:.0%}", (r["tokens"], r["bytes_window_aware"] / 2**20), textcoords="offset points",
                    xytext=(4, -12), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("document tokens")
    ax.set_ylabel("stored MiB")
    ax.set_title("Stored bytes of one document's states")
    ax.legend()
    save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, "gemma3-270m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from promptcache import PromptCache
    from promptcache.models.loading import load_model

    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    pc = PromptCache(model, tok)
    if not pc.adapter.sliding_windows():
        raise SystemExit(f"{args.model} has no sliding-window layer: window-aware storage keeps everything")
    rows = []
    for n in args.tokens:
        rows.append(measure(pc, n))
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    save_table("window_storage", rows, args.out, plot)


if __name__ == "__main__":
    main()
