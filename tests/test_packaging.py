"""Packaging: what the sdist takes from the clone, the metadata pyproject declares, and
what ``import fastattn.jax`` says when the XLA FFI handlers or jax are missing.

The builds themselves (``python -m build``, ``auditwheel repair``, the wheel and the sdist
in fresh environments, the rebuild command run for real) take minutes and the network:
they are .ci/package's, not these tests'."""
import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

import fastattn
from fastattn import _kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the clone (these tests live in it)
PKG = pathlib.Path(fastattn.__file__).resolve().parent  # the package under test
needs_clone = pytest.mark.skipif(not (ROOT / "MANIFEST.in").is_file(),
                                 reason="not run from a clone (no MANIFEST.in beside tests/)")


def _pyproject():
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _assigned(path, name):
    """The literal a module assigns to `name` at its top level, read without running it."""
    for node in ast.parse(pathlib.Path(path).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} assigns no {name}")


# ------------------------------------------------------------------------------ the sdist
@needs_clone
def test_manifest_takes_every_build_source_and_no_build_product(monkeypatch, tmp_path):
    """MANIFEST.in's rules, evaluated by setuptools over the clone: every file of src_c/
    (the C, the C++ of the jax handlers, the headers), the Cython source and stubs go into
    the sdist; a generated _kernels.c, an extension or build/ would not, were they there."""
    FileList = pytest.importorskip("setuptools.command.egg_info").FileList
    monkeypatch.chdir(ROOT)
    files = FileList()
    for line in (ROOT / "MANIFEST.in").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            files.process_template_line(line)
    taken = {pathlib.PurePath(f).as_posix() for f in files.files}
    need = {f"src_c/{p.name}" for p in (ROOT / "src_c").iterdir() if p.is_file()}
    need |= {f"fastattn/{p.name}" for p in (ROOT / "fastattn").iterdir()
             if p.suffix in (".pyx", ".pxd", ".pxi", ".pyi") or p.name == "py.typed"}
    need |= {"README.md", "LICENSE"}
    assert "src_c/jax_ffi.cc" in need
    assert not need - taken, sorted(need - taken)
    products = {t for t in taken if t.startswith("build/") or t.endswith((".so", ".o"))
                or t == "fastattn/_kernels.c"}
    assert not products, sorted(products)


# --------------------------------------------------------------------------- the metadata
@needs_clone
def test_extras_and_the_jax_pins_agree():
    """The `docs` extra is the four the docs build uses; the `jax` extra is the requirement
    fastattn.jax's messages name, and FASTATTN_JAX_FFI=1 builds against its lowest
    version (XLA takes handlers built against older FFI headers, not newer ones)."""
    extras = _pyproject()["project"]["optional-dependencies"]
    assert extras["docs"] == ["sphinx", "numpydoc", "pydata-sphinx-theme", "myst-parser"]
    (jax_req,) = extras["jax"]
    assert _assigned(PKG / "jax.py", "_JAX_REQUIREMENT") == jax_req
    lowest = jax_req.split(">=")[1]
    assert _assigned(ROOT / "setup.py", "JAX_BUILD_REQUIRES") == [f"jax=={lowest}"]


@needs_clone
def test_classifiers_and_license():
    """Trove classifiers for what CI builds and tests, the license by its SPDX name only
    (a License :: classifier beside it is an error to setuptools), keywords present."""
    project = _pyproject()["project"]
    cls = project["classifiers"]
    assert project["license"] == "MIT" and not [c for c in cls if c.startswith("License ::")]
    for c in ("Operating System :: POSIX :: Linux", "Programming Language :: C",
              "Programming Language :: Cython",
              "Topic :: Scientific/Engineering :: Artificial Intelligence"):
        assert c in cls
    low = tuple(int(x) for x in project["requires-python"].lstrip(">=").split("."))
    versions = [tuple(int(x) for x in c.rsplit(" ", 1)[1].split("."))
                for c in cls if c.startswith("Programming Language :: Python :: 3.")]
    assert versions and all(v >= low for v in versions)
    assert project["keywords"]


# ----------------------------------------------------------- import fastattn.jax's checks
def _import_jax_module(prelude):
    """Run `prelude`, then `import fastattn.jax`, in a child from tests/ (not the clone's
    root, whose fastattn/ would shadow the package under test)."""
    code = prelude + "\nimport fastattn.jax\n"
    return subprocess.run([sys.executable, "-c", code], cwd=pathlib.Path(__file__).parent,
                          capture_output=True, text=True, timeout=300)


NO_HANDLERS = "from fastattn import _kernels\n_kernels.jax_ffi_targets = lambda: None"
NO_JAX = "import sys\nsys.modules['jax'] = None"


def test_without_handlers_names_the_rebuild_command():
    """jax importable, the extension built without the handlers: an ImportError that says
    why and ends with the one command that rebuilds fastattn with them."""
    pytest.importorskip("jax")
    r = _import_jax_module(NO_HANDLERS)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fastattn.jax: this fastattn was built without its "
                           "XLA FFI handlers"), r.stderr
    cmd = last.split("rebuild it with them: ", 1)[1]
    assert "FASTATTN_JAX_FFI=1" in cmd and sys.executable in cmd


@pytest.mark.parametrize("handlers", [True, False], ids=["with-handlers", "without-handlers"])
def test_without_jax_names_the_install(handlers):
    """No jax: the message names jax's install, and the rebuild only where the handlers
    are missing too."""
    if handlers and _kernels.jax_ffi_targets() is None:
        pytest.skip("this fastattn was built without the handlers")
    r = _import_jax_module(NO_JAX + ("" if handlers else "\n" + NO_HANDLERS))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fastattn.jax needs JAX"), r.stderr
    run = last.split("; run: ", 1)[1]
    assert run.startswith(f"{sys.executable} -m pip install 'jax[cpu]>=")
    assert ("FASTATTN_JAX_FFI=1" in run) is (not handlers)


class _Dist:
    """importlib.metadata's distribution, as far as _rebuild_command reads it."""

    def __init__(self, direct_url):
        self.version = "0.1.0"
        self._direct = direct_url

    def read_text(self, name):
        assert name == "direct_url.json"
        return None if self._direct is None else json.dumps(self._direct)


def _rebuild_command(module_file, direct_url, monkeypatch):
    """fastattn.jax's _rebuild_command, taken from the installed source and run as if
    the module lived at `module_file` and pip had recorded `direct_url` (None: none)."""
    from importlib import metadata
    tree = ast.parse((PKG / "jax.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_rebuild_command"]
    ns = {"__file__": str(module_file)}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(PKG / "jax.py"), "exec"), ns)
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(direct_url))
    return ns["_rebuild_command"]()


def test_rebuild_command_for_each_way_of_installing(tmp_path, monkeypatch):
    py = sys.executable
    pip = f"FASTATTN_JAX_FFI=1 {py} -m pip install --force-reinstall --no-deps --no-cache-dir "
    site = tmp_path / "site-packages" / "fastattn" / "jax.py"
    # from a clone's directory (`pip install .`): that directory, with a space kept quoted
    got = _rebuild_command(site, {"url": "file:///src/my%20clone", "dir_info": {}}, monkeypatch)
    assert got == pip + "'/src/my clone'"
    # from an sdist file: that file
    got = _rebuild_command(site, {"url": "file:///d/fastattn-0.1.0.tar.gz",
                                  "archive_info": {}}, monkeypatch)
    assert got == pip + "/d/fastattn-0.1.0.tar.gz"
    # from an index, or a wheel file: the index's sdist of this version, built here
    for direct in (None, {"url": "file:///d/fastattn-0.1.0-cp311-cp311-linux_x86_64.whl",
                          "archive_info": {}}):
        assert _rebuild_command(site, direct, monkeypatch) == (
            pip + "--no-binary fastattn fastattn==0.1.0")
    # imported from a source tree (an in-place build or an editable install)
    clone = tmp_path / "clone"
    (clone / "src_c").mkdir(parents=True)
    (clone / "setup.py").write_text("")
    got = _rebuild_command(clone / "fastattn" / "jax.py", None, monkeypatch)
    assert got == f"cd {clone} && FASTATTN_JAX_FFI=1 {py} setup.py build_ext --inplace"


@pytest.mark.skipif(os.environ.get("FASTATTN_EXPECT_JAX_FFI", "") in ("", "0"),
                    reason="FASTATTN_EXPECT_JAX_FFI is not set")
def test_handlers_built_where_expected():
    """Where the build was meant to include the handlers (CI installs jax first), they are
    there: tests/test_jax.py would otherwise skip silently."""
    assert _kernels.jax_ffi_targets() is not None
