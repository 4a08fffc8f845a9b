"""Sphinx configuration of fastattn's documentation.

Build (from the repository root, with the package installed and the ``docs`` extra):

    pip install ".[docs]" && sphinx-build -W -b html docs docs/_build/html

The API reference is read from the docstrings of the installed package: this file
imports ``fastattn`` as Python finds it and adds no source folder to ``sys.path``
(the source folder has no compiled extension unless it was built in place).
"""
import importlib

try:
    fastattn = importlib.import_module("fastattn")
except ImportError as exc:  # the message of fastattn/__init__.py says what to do
    raise RuntimeError(f"the documentation is built from the installed fastattn: {exc}") from exc

project = "fastattn"
author = "the fastattn authors"
copyright = "fastattn authors, MIT licence"
release = version = fastattn.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "figures", "Thumbs.db", ".DS_Store"]

# Every cross-reference must resolve: a broken one is a warning, and the build runs
# with -W.  There is no intersphinx (the build needs no network), so the signatures
# show no annotations (they would link NumPy's and typing's names); each docstring's
# Parameters section gives the types.
nitpicky = True
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "member-order": "bysource"}
autosummary_generate = False

# numpydoc: the docstrings are in its format.  A public name documented here without
# a docstring fails the build (GL08); tests/test_docs.py checks the core API's
# docstrings with more of numpydoc's checks.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
numpydoc_validation_checks = {"GL08"}

# MyST for the Markdown guides: ``#`` anchors of headings to level 3 (the guides link
# to one another's sections), and $...$ maths.
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]

html_theme = "pydata_sphinx_theme"
html_title = f"fastattn {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_static_path: list = []


def _skip_tuple_fields(app, what, name, obj, skip, options):
    """A NamedTuple's fields are documented in its class docstring (numpydoc's
    Attributes section), not one by one: skip them as members."""
    if type(obj).__name__ == "_tuplegetter":
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _skip_tuple_fields)
