"""bench/perf_page.py in its --quick form: the page, its figure and the README's headline
block are written from one small run, every case checked against the oracle (and each
installed peer against fastattn) on the way; the timings themselves are not judged here."""
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import perf_page  # noqa: E402


def test_quick_page(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "performance.md"
    js = tmp_path / "run.json"
    assert perf_page.main(["--quick", "--out", str(out), "--json", str(js), "--no-readme"]) == 0
    text = out.read_text()
    for heading in ("## Prefill, float32", "## Short sequences", "## Decoding", "## Forward and backward",
                    "## bfloat16 forward", "## The configuration"):
        assert heading in text
    for label, *_ in (perf_page.QUICK["PREFILL"] + perf_page.QUICK["SHORT"] + perf_page.QUICK["BACKWARD"]
                      + perf_page.QUICK["BF16"] + perf_page.QUICK["DECODE"]):
        assert f"| {label} |" in text
    for cache in perf_page.CACHES:
        assert f"| {cache} |" in text
    assert (tmp_path / "figures" / "performance.png").stat().st_size > 10_000
    assert js.stat().st_size > 0


def test_headline_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{perf_page.README_START}\nold\n{perf_page.README_END}\n\nrest\n")
    assert perf_page.replace_headline(readme, "| new |")
    assert readme.read_text() == f"# x\n\n{perf_page.README_START}\n| new |\n{perf_page.README_END}\n\nrest\n"
    readme.write_text("# no block\n")
    assert not perf_page.replace_headline(readme, "| new |")
    assert readme.read_text() == "# no block\n"
