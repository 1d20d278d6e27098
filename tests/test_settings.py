"""The settings walker (``promptcache/settings.py``, ``frontend/walker.py``): options, variables and
config-file keys generated from any nested settings dataclasses, grouped by section in ``--help``;
the engine's file layout by section, the flat layout of before warned and still read."""

from __future__ import annotations

from dataclasses import dataclass, field

import click
import pytest
from click.testing import CliRunner

from promptcache.frontend.options import engine_config
from promptcache.frontend.walker import SettingsCommand, settings_from, settings_options
from promptcache.settings import leaves, nested, setting


@dataclass(frozen=True)
class Inner:
    size_budget: int | None = setting(None, "A size.")
    rate: float = setting(0.5, "A rate.", flat="inner_rate")
    on: bool = setting(True, "A switch.")

    def __post_init__(self):
        if not 0 <= self.rate <= 1:
            raise ValueError(f"Inner.rate must be in [0, 1], got {self.rate}")


@dataclass(frozen=True)
class Root:
    TITLE = "Throwaway (Root)"
    name: str = setting("x", "A name.")
    inner: Inner = nested(Inner, "Inner things (Root.inner)")
    names: tuple[str, ...] = field(default=())  # no help: the option says where it comes from


def _command(root=Root):
    @click.command(cls=SettingsCommand)
    @click.option("--own", default=None, help="The command's own option.")
    @settings_options(root, "values")
    def cmd(own, values):
        click.echo(repr(settings_from(root, values, env={})))

    return cmd


def test_a_throwaway_tree_gets_options_env_and_file_keys(tmp_path):
    cmd = _command()
    out = CliRunner().invoke(cmd, ["--help"]).output
    own, root, inner = out.index("Options:"), out.index("Throwaway (Root):"), out.index("Inner things (Root.inner):")
    assert own < root < inner and out.index("--own") < root and out.index("--inner-rate") > inner
    assert "--on / --no-on" in out and "[default 0.5; env PROMPTCACHE_INNER_RATE]" in out and "Root.names" in out
    res = CliRunner().invoke(cmd, ["--size-budget", "2KiB", "--inner-rate", "0.25", "--no-on", "--names", "a",
                                   "--names", "b"])
    assert res.output.strip() == repr(Root(inner=Inner(2048, 0.25, False), names=("a", "b")))
    toml = tmp_path / "c.toml"
    toml.write_text('name = "f"\nnames = ["p", "q"]\n[inner]\nrate = 0.75\n')
    env = {"PROMPTCACHE_ON": "no", "PROMPTCACHE_NAME": "e"}
    got = settings_from(Root, {"name": "cli"}, toml, env)
    assert got == Root(name="cli", inner=Inner(None, 0.75, False), names=("p", "q"))


def test_a_new_field_gets_its_option_with_no_edit_to_the_walker():
    @dataclass(frozen=True)
    class Grown(Inner):
        depth: int = setting(3, "A field added later.")

    @dataclass(frozen=True)
    class GrownRoot:
        inner: Grown = nested(Grown, "Grown")

    cmd = _command(GrownRoot)
    assert "--depth INT" in CliRunner().invoke(cmd, ["--help"]).output
    assert "depth=5" in CliRunner().invoke(cmd, ["--depth", "5"]).output
    assert settings_from(GrownRoot, {}, env={"PROMPTCACHE_DEPTH": "6"}).inner.depth == 6


def test_flat_names_are_unique_and_types_parsable_at_import():
    @dataclass(frozen=True)
    class Clash:
        inner_rate: float = 2.0  # Inner.rate's flat name is inner_rate too
        inner: Inner = nested(Inner)

    with pytest.raises(TypeError, match="flat name 'inner_rate' is used by both inner_rate and inner.rate"):
        leaves(Clash)

    @dataclass(frozen=True)
    class Odd:
        mapping: dict = field(default_factory=dict)

    with pytest.raises(TypeError, match="Odd.mapping: no command-line parser"):
        settings_options(Odd, "values")


def test_two_roots_on_one_command_may_not_share_a_flat_name():
    @dataclass(frozen=True)
    class Other:
        inner_rate: float = setting(1.0, "The same flat name as Root.inner.rate.")

    with pytest.raises(TypeError, match="options inner_rate are added twice"):
        settings_options(Other, "other")(settings_options(Root, "values")(lambda values, other: None))


def test_a_bad_value_names_where_it_came_from(tmp_path):
    with pytest.raises(ValueError, match="^environment PROMPTCACHE_INNER_RATE: Inner.rate must be in"):
        settings_from(Root, {}, env={"PROMPTCACHE_INNER_RATE": "3"})
    toml = tmp_path / "c.toml"
    toml.write_text("[inner]\nrate = 2.0\n")
    with pytest.raises(ValueError, match=f"^{toml} key inner.rate: Inner.rate must be in"):
        settings_from(Root, {}, toml, {})
    toml.write_text("[inner]\nrat = 2.0\n")
    with pytest.raises(ValueError, match="unknown keys inner.rat"):
        settings_from(Root, {}, toml, {})
    toml.write_text("server = 5\n")
    with pytest.raises(ValueError, match="server must be a table"):
        settings_from(Root, {}, toml, {}, table_path=("server",))


# -- the engine's file -----------------------------------------------------------------------------
def test_engine_file_by_section(tmp_path, capsys):
    toml = tmp_path / "e.toml"
    toml.write_text('namespace = "t"\n[runner]\nencode_chunk = 64\npacked_linear = true\n[store]\nhost_budget = "1GiB"\n'
                    '[recompute]\nfraction = 0.2\nselection = "qmatch"\n[server]\nport = 9000\n')
    cfg = engine_config({}, toml, env={})
    assert cfg.namespace == "t" and cfg.runner.encode_chunk == 64 and cfg.runner.packed_linear
    assert cfg.store.host_budget == 2**30 and cfg.recompute.fraction == 0.2  # [server] is serve's: not an error
    assert "warning" not in capsys.readouterr().err


def test_engine_file_flat_keys_are_refused_with_their_place(tmp_path):
    toml = tmp_path / "old.toml"
    toml.write_text('recompute = 0.3\nhost_budget = "2GiB"\nnamespace = "t"\n')
    with pytest.raises(ValueError, match=r"unknown keys recompute \(its place: \[recompute\] fraction\), "
                                         r"host_budget \(its place: \[store\] host_budget\)"):
        engine_config({}, toml, env={})
    toml.write_text('[engine]\nencode_chunk = 7\n')
    with pytest.raises(ValueError, match=r"unknown keys engine"):
        engine_config({}, toml, env={})
    toml.write_text("[runner]\ndevice = 'cuda'\n")
    with pytest.raises(ValueError, match="device are set by options"):
        engine_config({}, toml, env={})
