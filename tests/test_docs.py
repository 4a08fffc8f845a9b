"""The documentation against the code: the API reference covers every public name, the
core docstrings pass numpydoc's checks and their examples run, docs/cli.md lists every
option of the command lines and docs/environment.md every environment variable read.

The Sphinx build itself (warnings as errors) is a step of .ci/run."""
import argparse
import doctest
import importlib
import importlib.util
import inspect
import pathlib
import re

import pytest

import fastattn

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MODULES = ["fastattn", "fastattn.reference", "fastattn.geometry", "fastattn.torch",
           "fastattn.transformers", "fastattn.jax", "fastattn.dask", "fastattn.bench"]
CORE = ["fastattn", "fastattn.reference"]
# numpydoc's checks every core docstring passes (the build checks GL08 on all of them):
# closing quotes on their own line, no missing, unknown or misordered parameter, each
# one described, a Returns section where something is returned, and an example.
CHECKS = {"GL02", "GL08", "PR01", "PR02", "PR03", "PR07", "PR10", "RT01", "RT03", "EX01"}

needs_docs = pytest.mark.skipif(not (DOCS / "conf.py").is_file(),
                                reason="no docs/ beside the tests (not a clone)")


def _module(name):
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # an adapter whose framework is not installed
        pytest.skip(f"{name}: {exc}")


def _public(mod):
    """The public names of a module: its __all__, else what it defines without a
    leading underscore."""
    names = getattr(mod, "__all__", None)
    if names is not None:
        return [n for n in names if not n.startswith("__")]
    return [n for n, obj in vars(mod).items() if not n.startswith("_")
            and getattr(obj, "__module__", None) == mod.__name__]


@needs_docs
@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_is_in_the_api_reference(name):
    mod = _module(name)
    page = (DOCS / "api" / (name.split(".")[-1] + ".rst")).read_text()
    assert re.search(rf"^\.\. (auto)?module:: {re.escape(name)}$", page, re.M), \
        f"docs/api has no page for {name}"
    if re.search(rf"^\.\. automodule:: {re.escape(name)}\n(   :\S.*\n)*   :members:", page, re.M):
        return  # autodoc documents every name (of __all__ where there is one)
    listed = set(re.findall(r"^\.\. auto(?:function|class|data):: (\w+)", page, re.M))
    missing = [n for n in _public(mod) if n not in listed and not inspect.ismodule(getattr(mod, n))]
    assert not missing, f"{name}: not in docs/api: {missing}"


def _core_objects():
    for name in CORE:
        mod = importlib.import_module(name)
        for n in _public(mod):
            if not inspect.ismodule(getattr(mod, n)):
                yield f"{name}.{n}"


@pytest.mark.parametrize("qualname", list(_core_objects()))
def test_core_docstrings_pass_numpydoc(qualname):
    validate = pytest.importorskip("numpydoc.validate")
    errors = [f"{code}: {msg}" for code, msg in validate.validate(qualname)["errors"]
              if code in CHECKS]
    assert not errors, f"{qualname}:\n" + "\n".join(errors)


def _doctests(name):
    mod = _module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for n in _public(mod):
        obj = getattr(mod, n)
        if not inspect.ismodule(obj):
            # the module's namespace, as pytest --doctest-modules gives it
            tests += finder.find(obj, f"{name}.{n}", module=mod, globs=dict(vars(mod)))
    return [t for t in tests if t.examples]


def _missing_imports(test):
    """The top-level modules a docstring's examples import that are not installed (an
    optional extra, such as matplotlib for fastattn.geometry's drawings)."""
    names = set()
    for ex in test.examples:
        m = re.match(r"\s*(?:import|from)\s+(\w+)", ex.source)
        if m:
            names.add(m.group(1))
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    tests = _doctests(name)
    # a docstring whose examples import an optional package that is not installed is not
    # run (the test skips when none is left); every other example must pass
    missing = {t.name: _missing_imports(t) for t in tests}
    tests = [t for t in tests if not missing[t.name]]
    if not tests and any(missing.values()):
        pytest.skip(f"{name}: its examples need {sorted({n for v in missing.values() for n in v})}")
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    for t in tests:
        runner.run(t)
    res = runner.summarize(verbose=False)
    assert res.failed == 0, f"{res.failed} of {res.attempted} examples of {name} failed (printed above)"
    if name in CORE:
        assert res.attempted > 0, f"{name}: its docstrings have no examples"


# --- the command lines -------------------------------------------------------------

class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(main, monkeypatch):
    """The ArgumentParser a module's main() builds (caught when it parses)."""
    def catch(self, *args, **kwargs):
        raise _Parsed(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed) as info:
        main([])
    return info.value.parser


def _options(parser):
    """{'--opt METAVAR ...'} of a parser's visible options, as the docs write them."""
    out = set()
    for a in parser._actions:
        if a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
            continue
        opt = max(a.option_strings, key=len)
        if a.nargs == 0:
            out.add(opt)
            continue
        mv = a.metavar if a.metavar is not None else "N" if a.type is int else a.dest.upper()
        out.add(" ".join([opt, *(mv if isinstance(mv, tuple) else [mv])]))
    return out


def _documented(section):
    text = (DOCS / "cli.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^`(--[^`]+)`$", body, re.M))


@needs_docs
@pytest.mark.parametrize("module,section", [
    ("fastattn.__main__", "`fastattn` (`python -m fastattn`)"),
    ("fastattn.bench", "`python -m fastattn.bench`"),
    ("fastattn.geometry", "`python -m fastattn.geometry`")])
def test_cli_options_are_documented(module, section, monkeypatch):
    mod = importlib.import_module(module)
    got = _options(_parser_of(mod.main, monkeypatch))
    # `--threads N` in the docs: a metavar-less int option is written with N
    doc = _documented(section)
    assert got == doc, f"{module}: options {sorted(got)}, docs/cli.md lists {sorted(doc)}"


def test_the_command_parser_is_the_one_main_uses(monkeypatch):
    from fastattn import __main__ as cli
    assert _options(_parser_of(cli.main, monkeypatch)) == _options(cli.parser())


# --- the environment variables -----------------------------------------------------

SOURCES = ["fastattn/*.py", "fastattn/*.pyx", "fastattn/*.pxi", "src_c/*.c", "src_c/*.h",
           "src_c/*.cc", "setup.py", "tests/*.py", "bench/*.py", ".ci/*"]


@needs_docs
def test_every_environment_variable_is_documented():
    if not (ROOT / "src_c").is_dir():
        pytest.skip("no source tree beside the tests")
    found = set()
    for pattern in SOURCES:
        for path in ROOT.glob(pattern):
            if path.is_file():
                found |= set(re.findall(r"\bFASTATTN_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    found.discard("FASTATTN_H")  # src_c/fastattn.h's include guard
    assert {"FASTATTN_DISABLE_CPU_FEATURES", "FASTATTN_REQUIRE_OPENMP"} <= found  # the search works
    text = (DOCS / "environment.md").read_text()
    documented = set(re.findall(r"^`(FASTATTN_[A-Z0-9_]+)`$", text, re.M))
    assert found - documented == set(), f"undocumented in docs/environment.md: {sorted(found - documented)}"
    assert documented - found == set(), f"documented but read nowhere: {sorted(documented - found)}"
