"""A multi-turn chat whose long system prompt (a persona schema) is cached once.

Every turn is a prompt that imports the persona modules and adds the conversation so far, so
each turn pays only for the new messages. Reads turns from stdin when it is a terminal;
otherwise (or with --script) plays a short scripted conversation.

    python examples/chat.py                             # offline, embedded random-weight model
    python examples/chat.py --model Qwen/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from xml.sax.saxutils import escape

from promptcache import PromptCache

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ["Hi! Who are you?", "Suggest a weekend plan.", "Make it cheaper."]


def turn_prompt(history: list[tuple[str, str]], user: str) -> str:
    roles = "".join(f"<user>{escape(u)}</user><assistant>{escape(a)}</assistant>" for u, a in history)
    return (f'<prompt schema="persona"><character name="Mia" job="a tour guide"/><extravert/><intuition/>'
            f"<feeling/><perceiving/>{roles}<user>{escape(user)}</user></prompt>")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--script", action="store_true", help="play the scripted turns even on a terminal")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    pc = PromptCache.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    pc.add_schema(ROOT / "schemas" / "persona.xml")
    interactive = sys.stdin.isatty() and not args.script
    turns = iter(lambda: input("you> "), "") if interactive else iter(SCRIPT)
    history: list[tuple[str, str]] = []
    for user in turns:
        if not interactive:
            print(f"you> {user}")
        stream = pc.stream(turn_prompt(history, user), max_new_tokens=args.max_new_tokens, stop=["<|end|>"])
        print("bot> ", end="", flush=True)
        for piece in stream:
            print(piece, end="", flush=True)
        out = stream.result
        print(f"\n     [TTFT {out.ttft * 1e3:.1f} ms, {out.cached_tokens} cached / {out.new_tokens} new tokens]")
        history.append((user, out.text))


if __name__ == "__main__":
    main()
