"""``python -m promptcache.server ...`` is ``promptcache serve ...``."""

from .cli import serve

serve(prog_name="python -m promptcache.server")
