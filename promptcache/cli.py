"""The ``promptcache`` command line. Commands build configs and call the library; no logic here.

Over 300 lines on purpose: one click group, one short function per command whose docstring is
its ``--help`` text; a command that grows logic moves it into the library, not a second file.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import click

from .pml.errors import PMLError
from .server.cli import serve as serve_command

ASSETS = Path(__file__).resolve().parent / "assets" / "demo"
DEMO_QUESTION = "How was the water supply protected during the August wildfire?"


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def model_options(f):
    f = click.option("--dtype", default="auto", show_default=True,
                     help="float32, bfloat16 or float16; auto: float32 on CPU, bfloat16 on CUDA.")(f)
    f = click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available).")(f)
    f = click.option("--model", "-m", default="embedded", show_default=True,
                     help="Hugging Face model id, local directory, or 'embedded' / 'embedded:bench' "
                          "(random-weight models built from shipped configs, no download).")(f)
    return f


def _load_engine(model: str, device: str | None, dtype: str, config=None):
    from .engine import PromptCache
    from .models.loading import load_model

    device = device or _default_device()
    dtype = ("bfloat16" if device.startswith("cuda") else "float32") if dtype == "auto" else dtype
    click.echo(f"Loading model {model} on {device} ({dtype}) ...", err=True)
    if model.startswith("embedded"):
        click.echo("  note: embedded models have RANDOM weights: their text is noise, their speed is real.", err=True)
    m, tok = load_model(model, device=device, dtype=dtype)
    return PromptCache(m, tok, config)


@contextmanager
def _progress(label: str):
    """A click progress bar fed by the engine's (done, total) callback."""
    state = {"bar": None, "done": 0}

    def update(done: int, total: int) -> None:
        if state["bar"] is None:
            state["bar"] = click.progressbar(length=total, label=label, file=sys.stderr)
            state["bar"].__enter__()
        state["bar"].update(done - state["done"])
        state["done"] = done

    try:
        yield update
    finally:
        if state["bar"] is not None:
            state["bar"].__exit__(None, None, None)


def _fail(e: Exception, code: int = 1):
    msg = str(e)
    click.echo(f"error: {msg}" if not isinstance(e, PMLError) else msg, err=True)
    sys.exit(code)


def _guard(fn):
    """Turn the library's user-facing errors into messages and exit codes."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from .models import UnsupportedModelError
        from .rag import DocumentStoreError, UnknownDocumentError
        from .store import StoreError
        from .artifact import ArtifactError

        try:
            return fn(*args, **kwargs)
        except (PMLError, ArtifactError, StoreError, UnsupportedModelError, DocumentStoreError,
                UnknownDocumentError) as e:
            _fail(e, 1)
        except OSError as e:
            _fail(e, 2)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="promptcache")
def main():
    """Prompt Cache: reuse the attention states of prompt modules for fast time to first token.

    \b
    Quick tour (no network needed):
      promptcache demo
      promptcache inspect schemas/travel.xml examples/travel_tokyo.xml
      promptcache compile schemas/travel.xml --out build/travel
      promptcache run examples/travel_tokyo.xml --compiled build/travel
    """


@main.command()
@click.option("--model", "-m", default="embedded", show_default=True, help="Model id, directory or 'embedded'.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--max-new-tokens", default=16, show_default=True)
@_guard
def demo(model, device, max_new_tokens):
    """Compile a shipped schema, answer a prompt with and without the cache, compare.

    Uses an embedded random-weight model by default, so it runs offline; its text is noise.
    Two prompts: one importing every section in order (the cached state is exactly a plain
    prefill's, so the outputs must be identical) and one importing a subset (the paper's
    modular approximation: outputs may differ).
    """
    pc = _load_engine(model, device, "auto")
    schema = ASSETS / "long_doc_qa.xml"
    with tempfile.TemporaryDirectory(prefix="promptcache-demo-") as tmp:
        with _progress("Compiling schema") as bar:
            t0 = time.perf_counter()
            pc.compile(schema, Path(tmp) / "long_doc_qa", progress=bar)
        click.echo(f"Compiled {schema.name} in {time.perf_counter() - t0:.1f} s")
        pc.load_compiled(Path(tmp) / "long_doc_qa")
        sections = ["overview", "supply", "treatment", "distribution", "finances", "capital_plan", "customers",
                    "emergency"]
        prompts = {
            "every section, in order": "".join(f"<{s}/>" for s in sections),
            "three sections": "<supply/><distribution/><emergency/>",
        }
        for label, refs in prompts.items():
            prompt = f'<prompt schema="long_doc_qa">{refs}<user>{DEMO_QUESTION}</user></prompt>'
            pc.generate(prompt, max_new_tokens=1)  # warm-up
            pc.generate(prompt, max_new_tokens=1, use_cache=False)
            cached = pc.generate(prompt, max_new_tokens=max_new_tokens)
            full = pc.generate(prompt, max_new_tokens=max_new_tokens, use_cache=False)
            same = cached.token_ids == full.token_ids
            click.echo(f"\nPrompt: {label} ({cached.cached_tokens} cached + {cached.new_tokens} new tokens)")
            click.echo(f"  TTFT without cache: {full.ttft * 1e3:8.1f} ms")
            click.echo(f"  TTFT with cache:    {cached.ttft * 1e3:8.1f} ms   speed-up {full.ttft / cached.ttft:.1f}x")
            click.echo(f"  outputs identical:  {'yes' if same else 'no'}"
                       f" (state equals a plain prefill: {'yes' if cached.exact else 'no'})")
            click.echo(f"  output: {cached.text!r}")


@main.command()
@click.argument("prompt", type=click.Path(exists=True, dir_okay=False))
@click.option("--schema", "-s", "schemas", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Schema file(s) to encode before running (repeatable).")
@click.option("--compiled", "-c", "compiled", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="Compiled schema folder(s) from `promptcache compile` (repeatable).")
@click.option("--recompile", is_flag=True, help="Recompile a compiled schema that does not match the model.")
@model_options
@click.option("--no-cache", is_flag=True, help="Baseline: plain prefill of the same tokens, no module reuse.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--repetition-penalty", default=1.0, show_default=True, help="1 is off (transformers' definition).")
@click.option("--seed", default=None, type=int)
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
@_guard
def run(prompt, schemas, compiled, recompile, model, device, dtype, no_cache, max_new_tokens, temperature, top_p,
        top_k, repetition_penalty, seed, stop, as_json):
    """Answer PROMPT (a PML prompt file): stream the text, then one line of statistics.

    \b
    Examples:
      promptcache run examples/travel_tokyo.xml --schema schemas/travel.xml
      promptcache run examples/travel_tokyo.xml --compiled build/travel --json
      promptcache run examples/travel_tokyo.xml -s schemas/travel.xml --no-cache
    """
    from .engine import SamplingParams

    try:  # checked before the model loads
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                repetition_penalty=repetition_penalty, stop=stop, seed=seed)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    pc = _load_engine(model, device, dtype)
    for folder in compiled:
        pc.load_compiled(folder, recompile=recompile)
    for s in schemas:
        with _progress(f"Encoding {Path(s).name}") as bar:
            pc.add_schema(s, progress=bar)
    text = Path(prompt).read_text(encoding="utf-8")
    source = prompt if text.lstrip("\ufeff \t\r\n").startswith("<") else text  # a plain-text prompt file
    if as_json:
        out = pc.generate(source, params, use_cache=not no_cache)
        click.echo(json.dumps({"text": out.text, "token_ids": out.token_ids, "ttft_s": out.ttft,
                               "cached_tokens": out.cached_tokens, "new_tokens": out.new_tokens,
                               "exact": out.exact, "bytes_copied": out.bytes_copied, "hit_tiers": out.hit_tiers,
                               "finish_reason": out.finish_reason, "usage": dataclasses.asdict(out.usage)}))
        return
    stream = pc.stream(source, params, use_cache=not no_cache)
    for piece in stream:
        click.echo(piece, nl=False)
    out = stream.result
    if out is None:
        return
    tiers = ", ".join(f"{k} {v}" for k, v in sorted(out.hit_tiers.items())) or "none"
    click.echo(f"\n[TTFT {out.ttft * 1e3:.1f} ms | cached {out.cached_tokens} tokens | new {out.new_tokens} tokens"
               f" | tier hits: {tiers}{' | baseline (no cache)' if no_cache else ''}]")


@main.command()
@click.argument("schema", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False), help="Artifact folder to write.")
@model_options
@_guard
def compile(schema, out, model, device, dtype):
    """Encode SCHEMA once and write it as safetensors + manifest.json (atomically).

    \b
    Example:
      promptcache compile schemas/long_doc_qa.xml --model Qwen/Qwen2.5-0.5B-Instruct --out build/qa
    """
    pc = _load_engine(model, device, dtype)
    with _progress(f"Compiling {Path(schema).name}") as bar:
        path = pc.compile(schema, out, progress=bar)
    entry = pc.schema(pc.load_compiled(path).name)
    click.echo(f"Compiled '{entry.name}' to {path}: {entry.stored_tokens} tokens, "
               f"{entry.stored_bytes / 2**20:.1f} MiB of states")


@main.command()
@click.argument("schema", type=click.Path(exists=True, dir_okay=False))
@click.argument("prompt", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--model", "-m", default="embedded", show_default=True,
              help="Whose tokenizer to use (only the tokenizer is loaded).")
@_guard
def inspect(schema, prompt, model):
    """Print the spans of SCHEMA (and of PROMPT against it): positions, tokens, unions, parameters.

    \b
    Example:
      promptcache inspect schemas/travel.xml examples/travel_tokyo.xml
    """
    from .layout import layout_prompt, layout_schema

    tok = _load_tokenizer(model)
    layout = layout_schema(schema, tok)
    click.echo(layout.table())
    for u in layout.unions.values():
        click.echo(f"union u{u.index} (line {u.line}): members {', '.join(u.members)}; positions "
                   f"[{u.start}, {u.start + u.length}); scaffold {u.scaffold or '(none)'}")
    for m in layout.modules.values():
        for name, (_, p) in m.params.items():
            click.echo(f"parameter {'/'.join(m.path)}.{name}: {p.length} positions, scaffold {p.scaffold!r}")
    if prompt:
        click.echo("")
        click.echo(layout_prompt(prompt, layout, tok).table())


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--model", "-m", default="embedded", show_default=True,
              help="Tokenizer used to check argument lengths (only the tokenizer is loaded).")
def validate(files, model):
    """Check PML schema and prompt files; errors print as file:line: message (exit code 1).

    Prompts are checked against the schemas given alongside them (unknown modules, parameters,
    argument lengths); a prompt whose schema is not given is checked for syntax only.

    \b
    Example:
      promptcache validate schemas/*.xml examples/*.xml
    """
    from .layout import layout_prompt, layout_schema
    from .pml import parse_prompt, parse_schema
    from .pml.source import read_source

    tok, schemas, prompts, failed = None, {}, [], False
    for f in files:
        try:
            text, _, _ = read_source(f, "PML")
            kind = _root_tag(text)
            if kind == "schema":
                tok = tok or _load_tokenizer(model)
                layout = layout_schema(parse_schema(f), tok)
                schemas[layout.name] = layout
                click.echo(f"{f}: ok (schema '{layout.name}')")
            else:
                prompts.append((f, parse_prompt(f)))
        except PMLError as e:
            failed = True
            click.echo(str(e), err=True)
    for f, tree in prompts:
        try:
            if tree.schema is not None and tree.schema not in schemas:
                click.echo(f"{f}: ok (syntax only: schema '{tree.schema}' not given)")
                continue
            tok = tok or _load_tokenizer(model)
            layout_prompt(tree, schemas.get(tree.schema), tok)
            click.echo(f"{f}: ok (prompt)")
        except PMLError as e:
            failed = True
            click.echo(str(e), err=True)
    sys.exit(1 if failed else 0)


@main.command()
@click.option("--model", "-m", default="embedded:bench", show_default=True)
@click.option("--device", default=None)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--schema-tokens", default=2000, show_default=True)
@click.option("--new-tokens", default=32, show_default=True)
@click.option("--repeats", default=10, show_default=True)
@click.option("--kv-dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="dtype module states are stored in (default: the model's)")
@_guard
def bench(model, device, dtype, schema_tokens, new_tokens, repeats, kv_dtype):
    """Time to first token: full prefill vs Prompt Cache vs the limit (one process, ratios).

    The limit is the forward of the new tokens alone on an already assembled, preallocated cache,
    logits for the last token only. The default model is a random-weight Llama of realistic
    width (8 layers, hidden 1024, vocab 32000).
    """
    from . import bench as benchmark
    from .engine import EngineConfig

    pc = _load_engine(model, device, dtype, EngineConfig(kv_dtype=kv_dtype))
    click.echo("\n".join(benchmark.run(pc, schema_tokens, new_tokens, repeats).lines()))


def _root_tag(text: str) -> str:
    """'prompt' or 'schema' (anything else is parsed as a schema, whose parser names the problem)."""
    import re

    body = re.sub(r"<!--.*?-->|<\?.*?\?>|<!DOCTYPE[^>]*>", "", text, flags=re.S)
    m = re.search(r"<\s*([A-Za-z_][\w.-]*)", body)
    return "prompt" if m and m.group(1) == "prompt" else "schema"


def _load_tokenizer(model: str):
    from .models.embedded import embedded_tokenizer, is_embedded

    if is_embedded(model):
        return embedded_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except OSError as e:
        raise OSError(f"could not load the tokenizer of '{model}': {e}. Without network, pass a local "
                      "directory or use the embedded tokenizer (--model embedded).") from e


main.add_command(serve_command)

if __name__ == "__main__":
    main()
