"""Options declared once beside each method as plain dataclass fields (help in their comments, checks
by name in kvmini.methods.options): what the declarations promise, and that run.py, the registry and
the specs read everything from them."""
import dataclasses
import pathlib
import sys
import types
import typing
from dataclasses import dataclass
from typing import Literal

import pytest

from kvmini.errors import KvminiError
from kvmini.methods import options, registry
from kvmini.methods.options import Layers, Ratio, read, show
from kvmini.methods.registry import METHODS, declarations, every_option, make_policy, parse_spec
from kvmini.budget import Rule

NAMED = [name for name, module in METHODS.items() if module is not None]


@pytest.mark.parametrize("name", NAMED)
def test_each_method_declares_typed_options_with_help(name):
    module = METHODS[name]
    assert dataclasses.is_dataclass(module.Options) and module.Options.__dataclass_params__.frozen
    declared = {d.name: d for d in declarations(name)}
    for f in dataclasses.fields(module.Options):
        d = declared[f.name]
        assert d.help.strip(), f"{name}.{f.name} has no help"
        kind, default = d.kind, d.default
        assert options.fits(kind, default), f"{name}.{f.name}: default {default!r} is not a {kind}"
        if d.check is not None and not isinstance(default, Rule):
            assert d.check(default), f"{name}.{f.name}: default fails its own check"
        if not isinstance(default, Rule):  # text round trip: what --help shows reads back as the default
            assert read(kind, show(default, kind)) == default


@pytest.mark.parametrize("name", NAMED)
def test_a_method_module_needs_no_option_machinery(name):
    """The module a reader opens declares plain fields; reading, checking and printing live elsewhere."""
    source = pathlib.Path(METHODS[name].__file__).read_text()
    assert "kvmini.methods.options" not in source and "import options" not in source


def test_help_is_the_comment_beside_a_field_or_the_lines_just_above():
    @dataclass(frozen=True)
    class Base:
        a: int = 1  # beside a
        # above b, first line,
        # and its second
        b: str = "x # not a comment"

    @dataclass(frozen=True)
    class Mine(Base):  # a comment that is no field's
        c: bool = False

        d: float = 0.5  # beside d

    assert options.helps(Mine) == {"a": "beside a", "b": "above b, first line, and its second", "c": "",
                                   "d": "beside d"}
    assert options.helps(METHODS["pyramidkv"].Options)["window"] == options.helps(METHODS["snapkv"].Options)["window"]


def test_every_check_is_of_an_option_some_method_takes():
    """One table of checks by name: no entry for a name nothing declares; a module's own checks are
    of options only that module takes, so they cannot give a shared name a second meaning."""
    flags = every_option()
    assert set(options.CHECKS) <= set(flags)
    for name in NAMED:
        own = getattr(METHODS[name], "CHECKS", {})
        assert not set(own) & set(options.CHECKS), name
        assert all(flags[option][1] == [name] for option in own), name


@pytest.mark.parametrize("name", [n for n in NAMED if hasattr(METHODS[n], "VARIANTS")])
def test_variants_are_instances_and_the_declared_defaults_are_the_default_variant(name):
    module = METHODS[name]
    assert all(isinstance(v, module.Options) for v in module.VARIANTS.values())
    assert module.VARIANTS[module.DEFAULT_VARIANT] == module.Options()


def test_an_option_name_means_one_thing_in_every_method():
    """run.py has one flag per name: every method that declares it declares the same type and help."""
    seen = {}
    for name in NAMED:
        for d in declarations(name):
            kind, help_ = seen.setdefault(d.name, (d.kind, d.help))
            assert (d.kind, d.help) == (kind, help_), f"{d.name} differs in {name}"


def test_one_reader_for_every_edge():
    assert [read(bool, t) for t in ("true", "Yes", "on", "1", "false", "NO", "off", "0")] == [True] * 4 + [False] * 4
    assert read(int, " +12 ") == 12 and read(int, "-1") == -1 and read(float, "1e-3") == 0.001
    assert read(Layers, "0,1,-1") == (0, 1, -1) == read(Layers, "0;1;-1") and read(Layers, "") == ()
    assert read(Ratio, "3:1") == (3, 1) and show((3, 1), Ratio) == "3:1" and show((), Layers) == "none"
    assert read(Literal["mean", "max", "sum"], "max") == "max" and show(0.5) == "0.5" and show(20.0) == "20"
    for kind, text in [(bool, "maybe"), (int, "٣"), (int, "1e3"), (int, "2.5"), (float, "inf"), (float, "nan"),
                       (float, "١.٥"), (Layers, "0,x"), (Layers, "¹"), (Ratio, "3-1"), (Ratio, "²:1"),
                       (Literal["mean", "max", "sum"], "median")]:
        with pytest.raises(ValueError):
            read(kind, text)


def test_text_and_typed_values_build_the_same_policy():
    typed = make_policy("d2o", 0.2, nm=(3, 1), protected_layers=(0, -1), clamp_budgets=False, beta=0.3)
    text = make_policy("d2o", 0.2, nm="3:1", protected_layers="0;-1", clamp_budgets="false", beta="0.3")
    for p in (typed, text):
        assert p.protected_spec == (0, -1) and p.o.nm == (3, 1) and p.o.clamp_budgets is False
    with pytest.raises(KvminiError, match=r"--nm must be a pair of whole numbers \(N, M\), got \[3, 1\]"):
        make_policy("d2o", 0.2, nm=[3, 1])
    with pytest.raises(KvminiError, match="--recent must be a whole number of at most 2,147,483,647 in size, got 2.5"):
        make_policy("h2o", 0.2, recent=2.5)
    with pytest.raises(KvminiError, match="--pooling must be avg or max, got mean"):
        make_policy("snapkv", 0.2, pooling="mean")


def test_a_rule_prints_itself_and_an_unnamed_function_is_refused():
    assert str(registry.method_options("h2o")["recent"]) == "budget // 2"
    assert Rule.of_(Rule("budget - 4", lambda b: b - 4), "recent")(10) == 6 and Rule.of_(3, "recent")(99) == 3
    with pytest.raises(KvminiError, match="recent must be a whole number or a Rule"):
        from kvmini.methods import h2o
        h2o.H2O(0.2, h2o.Options(recent=lambda b: b // 2))


def test_run_py_flags_come_from_the_declarations():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
    import run

    flags = every_option()
    args = run.parse_args(["--prompt", "p.txt", "--method", "d2o", "--nm", "3:1", "--protected-layers", "0,-1",
                           "--clamp-budgets", "no", "--beta", "0.25"])
    assert args.options == {"nm": (3, 1), "protected_layers": (0, -1), "clamp_budgets": False, "beta": 0.25}
    text = run.methods_help()
    for name in NAMED:
        for d in declarations(name):
            assert d.name in flags and "--" + d.name.replace("_", "-") in text
    assert "--nm [paper: 3:1, official: 1:1]" in text and "--recent [budget // 2]" in text


def test_a_new_method_with_a_new_option_needs_its_module_and_one_registry_line(monkeypatch):
    """What tutorial 9 does: a module with its Options and build(), one entry in METHODS; the flag,
    its help, its check (the module's own CHECKS), the spec syntax and the report follow: no shared file."""
    from kvmini.methods.method import Method
    from kvmini.methods.selectors import shrink

    class VNorm(Method):
        schedule = "prefill"

        def after_attention(self, layer, cache, stats, step):
            lc, b = cache[layer], step.budgets[layer]
            if step.compresses and step.completes and lc.length > b:
                shrink(lc, lc.values.norm(dim=-1), b, 0, 0, step.newest)  # the largest values stay

    @dataclass(frozen=True)
    class Options:
        norm_power: float = 2.0  # which norm of the values

    mine = types.ModuleType("vnorm", "VNorm: keep the largest values.")
    mine.Options = Options
    mine.CHECKS = {"norm_power": (lambda x: x >= 1, "be >= 1")}
    def build(budget, o=Options()) -> VNorm:  # the class it returns: its schedule is read off it
        return VNorm("vnorm", budget)

    mine.build = build
    monkeypatch.setitem(METHODS, "vnorm", mine)
    registry.declarations.cache_clear()
    try:
        assert parse_spec("vnorm[norm_power=3]") == ("vnorm", {"norm_power": 3.0})
        assert make_policy("vnorm", 0.5, norm_power=1.5).name == "vnorm"
        with pytest.raises(KvminiError, match="--norm-power must be >= 1, got 0.5"):
            make_policy("vnorm", 0.5, norm_power=0.5)
        flags = every_option()
        assert flags["norm_power"][1] == ["vnorm"] and flags["norm_power"][0].help == "which norm of the values"
    finally:
        registry.declarations.cache_clear()
