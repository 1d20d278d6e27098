"""What every command-line front end shares: the ``promptcache`` commands (``cli/``) and the
server's ``serve`` (``server/cli.py``).

    walker.py   settings dataclasses -> options (a --help heading per section), PROMPTCACHE_*
                variables and config-file keys; generic over any nested settings tree
    options.py  option groups: the model, and one option per EngineConfig leaf (generated)
    errors.py   library errors -> one line and an exit code (``guard``)
    common.py   the device check, loading an engine or a tokenizer, reading a prompt, logging

It sits below both (``server`` and ``cli`` import it; it imports neither), which is what keeps
the two apart: ``cli`` imports ``server`` for ``serve``, never the reverse.
"""
