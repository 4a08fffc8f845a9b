"""The adapters' docstrings (fastattn.geometry, .torch, .transformers, .jax, .dask,
.bench) checked with numpydoc's validator, as the API reference renders them.

Every public name (the module's ``__all__``, and the public methods and properties of
its classes) must have a docstring whose summary, Parameters, Returns/Yields and
sections are well formed and whose Parameters match the signature.  Not required:
an extended summary (ES01), a See Also section (SA01) or a description for each
See Also entry (SA04), and an Examples section (EX01).  The examples themselves run
as doctests (``pytest --doctest-modules fastattn/``).

Skipped without numpydoc (``pip install numpydoc``), and per module without the
framework it adapts.
"""
import doctest
import importlib
import inspect

import pytest

validate = pytest.importorskip("numpydoc.validate")
docscrape = pytest.importorskip("numpydoc.docscrape")

MODULES = ("fastattn.geometry", "fastattn.torch", "fastattn.transformers", "fastattn.jax",
           "fastattn.dask", "fastattn.bench")
NOT_REQUIRED = {"ES01", "SA01", "SA04", "EX01"}
# the frameworks each module needs, for a clean skip where one is missing
NEEDS = {"fastattn.torch": ("torch",), "fastattn.transformers": ("torch", "transformers"),
         "fastattn.jax": ("jax",), "fastattn.dask": ("dask.array",)}


def _import(name):
    """The module, or a skip where a framework it adapts is not installed."""
    for dep in NEEDS.get(name, ()):
        pytest.importorskip(dep)
    return importlib.import_module(name)


def _public(mod):
    """(qualified name, object) of the module and each public name it documents."""
    yield mod.__name__, mod
    for name in mod.__all__:
        obj = getattr(mod, name)
        if not (callable(obj) or inspect.isclass(obj)):
            continue  # constants: documented in the module's docstring or comments
        qual = f"{mod.__name__}.{name}"
        yield qual, obj
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if inspect.isfunction(member) or isinstance(member, (property, classmethod,
                                                                     staticmethod)):
                    yield f"{qual}.{attr}", getattr(obj, attr, member)


def _errors(qual, obj):
    # (the torch.library ops, CustomOpDef objects, carry the docstring and signature of
    # the function they were made from: the check reads what help() and Sphinx read)
    res = validate.validate(qual)
    return [f"{qual}: {code} {msg}" for code, msg in res["errors"] if code not in NOT_REQUIRED]


@pytest.mark.parametrize("module", MODULES)
def test_public_names_have_valid_numpydoc_docstrings(module):
    mod = _import(module)
    names = list(_public(mod))
    assert len(names) > 1, f"{module}.__all__ lists nothing to document"
    errors = [e for qual, obj in names for e in _errors(qual, obj)]
    assert not errors, "\n".join(errors)


def test_the_check_fails_on_a_missing_docstring_and_an_undocumented_parameter():
    """The validator this file relies on does flag what it must (else the test above
    could pass on anything)."""

    def undocumented(x):
        return x

    def half_documented(x, y):
        """Add two numbers.

        Parameters
        ----------
        x : int
            The first.

        Returns
        -------
        int
            The sum.
        """
        return x + y

    codes = {code for f in (undocumented, half_documented)
             for code, _ in validate.validate(docscrape.get_doc_object(f))["errors"]}
    assert {"GL08", "PR01"} <= codes


@pytest.mark.parametrize("module, name, words", [
    ("fastattn.torch", None, ("bfloat16", "float16", "QuantizedKV")),
    ("fastattn.torch", "scaled_dot_product_attention", ("float32", "float64", "bfloat16",
                                                        "float16")),
    ("fastattn.torch", "attention", ("bfloat16", "QuantizedKV", "int8")),
    ("fastattn.torch", "quantize_kv", ("bfloat16", "int8")),
    ("fastattn.jax", "dot_product_attention", ("float64", "bfloat16", "float16")),
    ("fastattn.dask", "attention", ("bfloat16", "QuantizedKV")),
    ("fastattn.geometry", "entropy_profile", ("bfloat16",)),
])
def test_dtype_statements_name_bfloat16_and_the_int8_cache(module, name, words):
    mod = _import(module)
    doc = inspect.getdoc(mod if name is None else getattr(mod, name)) or ""
    missing = [w for w in words if w not in doc]
    assert not missing, f"{module}.{name or ''} docstring does not mention {missing}"


def test_the_registered_ops_examples_run():
    """pytest --doctest-modules does not collect the docstrings of the torch.library ops
    (CustomOpDef objects, not functions): their examples run here."""
    ft = _import("fastattn.torch")
    report = []
    runner = doctest.DocTestRunner()
    for name in ("attention_fwd", "attention_bwd"):
        for test in doctest.DocTestFinder().find(getattr(ft, name), f"fastattn.torch.{name}",
                                                 globs={}):
            runner.run(test, out=report.append)
    assert runner.tries > 0 and runner.failures == 0, "".join(report)
