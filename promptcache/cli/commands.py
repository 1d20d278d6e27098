"""The working commands: run, compile, inspect, validate, bench. Each builds configs and calls the
library; errors go through ``errors.guard`` (one line, an exit code)."""

from __future__ import annotations

import dataclasses
import json
import sys
from inspect import cleandoc
from pathlib import Path

import click
from click.core import ParameterSource

from .. import jsonsafe
from ..frontend.common import load_engine, load_tokenizer, read_prompt, setup_logging
from ..frontend.errors import guard
from ..frontend.options import DTYPES, engine_config, engine_options, model_options
from ..frontend.walker import SettingsCommand

# `run --json` prints one object with these fields (also listed in `promptcache run --help`).
JSON_FIELDS = {
    "text": "the generated text",
    "token_ids": "generated token ids (an EOS or stop token included)",
    "ttft_s": "seconds from prompt to first-token logits",
    "cached_tokens": "prompt tokens laid out from stored states (recomputed ones included)",
    "new_tokens": "prompt tokens run through the model (cached_tokens + new_tokens = the prompt)",
    "recomputed_tokens": "of cached_tokens, those computed afresh because their stored states drifted",
    "exact": "true when the state equals a plain prefill's (full prefill's answer); false: approximate",
    "bytes_copied": "stored KV bytes copied to assemble the prompt",
    "hit_tiers": "cached spans served per tier (device, host, disk, remote)",
    "finish_reason": "stop, length or cancelled",
    "usage": "OpenAI-style counts: prompt_tokens, completion_tokens, cached_tokens (served from stored "
             "states: recomputed ones excluded), total_tokens",
}
_JSON_HELP = "\n".join(f"  {k}: {v}" for k, v in JSON_FIELDS.items())

src_root_option = click.option("--src-root", type=click.Path(exists=True, file_okay=False), default=None,
                               help="Folder src= files may come from (default: each schema file's folder).")


def _schema_name(compiled_dir: str) -> str | None:
    try:
        return jsonsafe.loads((Path(compiled_dir) / "manifest.json").read_text(encoding="utf-8"))["schema"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # load_compiled names the problem


def _recorded_model(compiled_dir: str) -> tuple[str, str] | None:
    """(model, dtype) a compiled folder records it was compiled for (None: not recorded)."""
    try:
        manifest = jsonsafe.loads((Path(compiled_dir) / "manifest.json").read_text(encoding="utf-8"))
        name, dtype = manifest.get("model_name"), manifest["model"].get("dtype")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # load_compiled names the problem
    return (name, dtype) if isinstance(name, str) and name and isinstance(dtype, str) else None


def _model_of_compiled(compiled: tuple[str, ...], model: str, dtype: str) -> tuple[str, str]:
    """``--compiled`` without ``--model``: the model (and, without ``--dtype``, the dtype) the first
    compiled folder records, said on stderr; otherwise what the options say."""
    ctx = click.get_current_context()
    if not compiled or ctx.get_parameter_source("model") != ParameterSource.DEFAULT:
        return model, dtype
    recorded = _recorded_model(compiled[0])
    if recorded is None:
        return model, dtype
    if ctx.get_parameter_source("dtype") == ParameterSource.DEFAULT and recorded[1] in DTYPES:
        dtype = recorded[1]
    click.echo(f"model: {recorded[0]} ({dtype}), the model {compiled[0]} was compiled for "
               "(--model chooses another)", err=True)
    return recorded[0], dtype


def _load_compiled(pc, folder: str, schema: Path | None, recompile: bool) -> None:
    """Load a compiled folder, checked against its schema source when given; a stale artifact is
    refused (exit 1) or, with --recompile, recompiled -- and the command says which. An artifact
    of another model or tokenizer is refused even with --recompile (``compiled.load_compiled``)."""
    from ..artifact import ArtifactError

    try:
        entry = pc.load_compiled(folder, schema=schema)
        click.echo(f"Loaded compiled schema '{entry.name}' from {folder}"
                   f"{f' (matches {schema})' if schema else ''}", err=True)
    except ArtifactError as e:
        if not recompile:
            raise
        pc.load_compiled(folder, schema=schema, recompile=True)  # refuses another model's artifact
        click.echo(f"Recompiled {folder}{f' from {schema}' if schema else ''}: {' '.join(str(e).split())}", err=True)


@click.command(cls=SettingsCommand)
@click.argument("prompt", required=False)
@click.option("--prompt", "-p", "prompt_text", default=None, help="The prompt as text (PML or plain), not a file.")
@click.option("--schema", "-s", "schemas", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Schema file(s) to encode (repeatable); with --compiled, the schema a compiled folder of "
                   "the same name must match.")
@click.option("--compiled", "-c", "compiled", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="Compiled schema folder(s) from `promptcache compile` (repeatable); without --model, the "
                   "model (and dtype) the first one was compiled for is loaded.")
@click.option("--recompile", is_flag=True, help="Recompile a compiled schema whose schema text changed or that is damaged (one compiled for "
              "another model or tokenizer is refused, never overwritten).")
@src_root_option
@model_options
@engine_options
@click.option("--no-cache", is_flag=True, help="Baseline: plain prefill of the same tokens, no module reuse.")
@click.option("--max-new-tokens", default=128, show_default=True, help="Most tokens to generate.")
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling: keep the smallest set of tokens with this much probability (1 is off).")
@click.option("--top-k", default=0, show_default=True, help="Sample among the k most likely tokens only (0 is off).")
@click.option("--repetition-penalty", default=1.0, show_default=True, help="1 is off (transformers' definition).")
@click.option("--seed", default=None, type=int, help="Random seed for sampling (default: a fresh one).")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming (fields below).")
@click.option("--raw", is_flag=True,
              help="Send a plain-text prompt as it is; by default it becomes a user turn of the model's chat template.")
@guard
def run(prompt, prompt_text, schemas, compiled, recompile, src_root, model, device, dtype, engine, config_file,
        no_cache, max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, as_json, raw):
    """Answer PROMPT (a PML or plain-text file, '-' for stdin, or -p TEXT): stream the text, then
    one line of statistics. Plain text to a model with a chat template is sent as a user turn
    (--raw: as it is).

    \b
    Examples (SCHEMA.xml: a schema file; PROMPT.xml: a prompt using it):
      promptcache run PROMPT.xml --schema SCHEMA.xml
      promptcache run PROMPT.xml --compiled build/s --schema SCHEMA.xml --json
      promptcache run -p '<prompt schema="s"><intro/><user>Hi</user></prompt>' -s SCHEMA.xml
      echo 'Hello' | promptcache run -

    \b
    --json fields:
    """
    from ..engine import SamplingParams

    setup_logging()
    source = read_prompt(prompt, prompt_text)
    try:  # checked before the model loads
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                repetition_penalty=repetition_penalty, stop=stop, seed=seed)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    config = engine_config(engine, config_file)
    model, dtype = _model_of_compiled(compiled, model, dtype)
    pc = load_engine(model, device, dtype, config)
    by_name = {}
    if compiled:
        from ..pml import parse_schema

        by_name = {parse_schema(Path(s), allow_src_root=src_root).name: Path(s) for s in schemas}
    paired = set()
    for folder in compiled:
        schema = by_name.get(_schema_name(folder))
        paired.add(schema)
        _load_compiled(pc, folder, schema, recompile)
    for s in schemas:
        if Path(s) not in paired:
            pc.add_schema(Path(s), allow_src_root=src_root)
    source = _as_turn(pc, source, raw)
    _check_schema_given(pc, source)
    if as_json:
        out = pc.generate(source, params, use_cache=not no_cache)
        click.echo(json.dumps({"text": out.text, "token_ids": out.token_ids, "ttft_s": out.ttft,
                               "cached_tokens": out.cached_tokens, "new_tokens": out.new_tokens,
                               "recomputed_tokens": out.recomputed_tokens, "exact": out.exact,
                               "bytes_copied": out.bytes_copied, "hit_tiers": out.hit_tiers,
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
               f" | recomputed {out.recomputed_tokens} | {'exact' if out.exact else 'approximate'}"
               f" | tier hits: {tiers}{' | baseline (no cache)' if no_cache else ''}]")


def _as_turn(pc, source, raw: bool):
    """Plain text (not PML) to a chat-template model becomes ``<prompt><user>TEXT</user></prompt>``,
    so the template's turn markers and generation prompt wrap it, as chat clients do."""
    from xml.sax.saxutils import escape

    from ..pml.source import is_markup

    if raw or not isinstance(source, str) or is_markup(source) or not getattr(pc.tokenizer, "chat_template", None):
        return source
    return f"<prompt><user>{escape(source.strip())}</user></prompt>"


def _check_schema_given(pc, source) -> None:
    """A prompt naming a schema that was not given: say which flag loads it."""
    from ..pml import PMLError, parse_prompt
    from ..pml.source import is_markup

    if isinstance(source, str) and not is_markup(source):
        return
    tree = parse_prompt(source)
    if tree.schema is not None and tree.schema not in pc.schemas:
        known = ", ".join(pc.schemas) or "none"
        raise PMLError(f"unknown schema '{tree.schema}' (schemas loaded: {known}); pass its schema file with "
                       "--schema/-s FILE (or a compiled folder with --compiled DIR)", tree.source, tree.line)


run.help = cleandoc(run.help or "") + "\n" + _JSON_HELP  # the fields, from the one list above


@click.command(cls=SettingsCommand)
@click.argument("schema", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False), help="Artifact folder to write.")
@model_options
@engine_options
@guard
def compile(schema, out, model, device, dtype, engine, config_file):
    """Encode SCHEMA (a schema file) once and write it as safetensors + manifest.json (atomically).

    The artifact embeds the schema's src= files, so they must lie in the schema's folder (no
    --src-root here: the artifact format refuses paths outside it).

    \b
    Example:
      promptcache compile SCHEMA.xml --model Qwen/Qwen2.5-0.5B-Instruct --out build/s
    """
    setup_logging()
    config = engine_config(engine, config_file)
    pc = load_engine(model, device, dtype, config)
    path = pc.compile(Path(schema), out)
    entry = pc.schema(pc.load_compiled(path).name)
    click.echo(f"Compiled '{entry.name}' to {path}: {entry.layout.summary()}, "
               f"{entry.stored_bytes / 2**20:.1f} MiB of states")


def _tokenizer_line(model: str) -> str:
    kind = "embedded tokenizer (pass --model for your model's)" if model.startswith("embedded") else f"tokenizer of '{model}'"
    return f"tokenizer: {kind}"


@click.command()
@click.argument("schema", type=click.Path(exists=True, dir_okay=False))
@click.argument("prompt", required=False)
@click.option("--prompt", "-p", "prompt_text", default=None, help="The prompt as text instead of a file.")
@click.option("--model", "-m", default="embedded", show_default=True,
              help="Whose tokenizer to use (only the tokenizer is loaded).")
@src_root_option
@guard
def inspect(schema, prompt, prompt_text, model, src_root):
    """Print the spans of SCHEMA (and of PROMPT against it): positions, tokens, unions, parameters.

    \b
    Example:
      promptcache inspect SCHEMA.xml PROMPT.xml --model Qwen/Qwen2.5-0.5B-Instruct
    """
    from ..layout import layout_prompt, layout_schema
    from ..models.loading import model_context

    tok, context = load_tokenizer(model), model_context(model)  # the context compile checks against
    click.echo(_tokenizer_line(model))
    layout = layout_schema(Path(schema), tok, allow_src_root=src_root, max_positions=context)
    click.echo(layout.table())
    for u in layout.unions.values():
        click.echo(f"union u{u.index} (line {u.line}): members {', '.join(u.members)}; positions "
                   f"[{u.start}, {u.start + u.length}); scaffold {u.scaffold or '(none)'}")
    for m in layout.modules.values():
        for name, (_, p) in m.params.items():
            click.echo(f"parameter {'/'.join(m.path)}.{name}: {p.length} positions, scaffold {p.scaffold!r}")
    if prompt or prompt_text:
        click.echo("")
        click.echo(layout_prompt(read_prompt(prompt, prompt_text), layout, tok, max_positions=context).table())


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--model", "-m", default="embedded", show_default=True,
              help="Tokenizer used to lay out and check lengths (only the tokenizer is loaded).")
@src_root_option
@guard
def validate(files, model, src_root):
    """Check PML schema and prompt files; errors print as file:line: message (exit code 1).

    Prompts are checked against the schemas given alongside them (unknown modules, parameters,
    argument lengths); a prompt naming a schema that is not among the files is an error. The
    first line says which tokenizer was used: lengths depend on it, so pass --model.

    \b
    Example:
      promptcache validate schemas/*.xml examples/*.xml --model Qwen/Qwen2.5-0.5B-Instruct
    """
    from ..layout import layout_prompt, layout_schema
    from ..models.loading import model_context
    from ..pml import PMLError, parse_prompt, parse_schema

    tok, context = load_tokenizer(model), model_context(model)  # the context compile checks against
    click.echo(_tokenizer_line(model))
    schemas, prompts, failed = {}, [], False
    for f in files:
        try:
            if _root_tag(Path(f).read_text(encoding="utf-8", errors="replace")) == "schema":
                layout = layout_schema(parse_schema(Path(f), allow_src_root=src_root), tok, max_positions=context)
                schemas[layout.name] = layout
                click.echo(f"{f}: ok (schema '{layout.name}': {layout.summary()})")
            else:
                prompts.append((f, parse_prompt(Path(f))))
        except PMLError as e:
            failed = True
            click.echo(str(e), err=True)
    for f, tree in prompts:
        try:
            if tree.schema is not None and tree.schema not in schemas:
                known = ", ".join(sorted(schemas)) or "none"
                raise PMLError(f"unknown schema '{tree.schema}' (schemas given: {known}); pass its schema file "
                               "alongside the prompt", str(f), getattr(tree, "line", None))
            layout_prompt(tree, schemas.get(tree.schema), tok, max_positions=context)
            click.echo(f"{f}: ok (prompt)")
        except PMLError as e:
            failed = True
            click.echo(str(e), err=True)
    sys.exit(1 if failed else 0)


@click.command(cls=SettingsCommand)
@click.option("--model", "-m", default="embedded:bench", show_default=True, help="The model to time (see run --model).")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available).")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(("auto", "float32", "bfloat16", "float16")),
              help="auto: the checkpoint's dtype where the device computes it natively, else float32 "
                   "(embedded models: float32 on CPU, bfloat16 on CUDA).")
@engine_options
@click.option("--schema-tokens", default=2000, show_default=True, help="Tokens of the synthetic schema timed.")
@click.option("--new-tokens", default=32, show_default=True, help="New prompt tokens run on top of the cached ones.")
@click.option("--repeats", default=10, show_default=True, help="Timed runs per method (the median is reported).")
@guard
def bench(model, device, dtype, engine, config_file, schema_tokens, new_tokens, repeats):
    """Time to first token: full prefill vs Prompt Cache vs the limit (one process, ratios).

    The limit is the forward of the new tokens alone on a ready, assembled cache. The default
    model is a random-weight Llama of realistic width (8 layers, hidden 1024, vocab 32000).
    Each step is announced on stderr as it starts.
    """
    from .. import bench as benchmark

    setup_logging()
    config = engine_config(engine, config_file)
    pc = load_engine(model, device, dtype, config)
    report = benchmark.run(pc, schema_tokens, new_tokens, repeats,
                           announce=lambda step: click.echo(f"bench: {step} ...", err=True))
    click.echo("\n".join(report.lines()))


def _root_tag(text: str) -> str:
    """'prompt' or 'schema' (anything else is parsed as a schema, whose parser names the problem)."""
    import re

    body = re.sub(r"<!--.*?-->|<\?.*?\?>|<!DOCTYPE[^>]*>", "", text, flags=re.S)
    m = re.search(r"<\s*([A-Za-z_][\w.-]*)", body)
    return "prompt" if m and m.group(1) == "prompt" else "schema"
