"""bench/mca_model.py, the port model of the forward's hot loops: its loop finding on a
made-up disassembly (no llvm-mca needed), and with LLVM 19's llvm-mca (where installed)
its predictions for a loop whose answer is known."""
import importlib.util
import os
import shutil

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "..", "bench", "mca_model.py")
if not os.path.exists(PATH):
    pytest.skip("bench/mca_model.py is not beside this test (an installed test run)", allow_module_level=True)
spec = importlib.util.spec_from_file_location("mca_model", PATH)
mca_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mca_model)

# an outer loop (0x10-0x40) around an inner one (0x14-0x30), and a later inner loop
INSNS = [
    (0x10, "mov %rdi,%rax"),
    (0x14, "vmovaps (%rax),%zmm1"),
    (0x1a, "vbroadcastss (%rsi),%zmm2"),
    (0x20, "vfmadd231ps %zmm1,%zmm2,%zmm3"),
    (0x26, "vfmadd231ps %zmm1,%zmm2,%zmm4"),
    (0x2c, "add $0x40,%rax"),
    (0x30, "jne 14"),
    (0x36, "add $0x4,%rsi"),
    (0x40, "jne 10"),
    (0x44, "vscalefps %zmm1,%zmm2,%zmm5"),
    (0x4a, "vfmadd231ps %zmm1,%zmm2,%zmm6"),
    (0x50, "jb 44"),
]


def test_innermost_loops_and_pick():
    loops = mca_model.innermost_loops(INSNS)
    assert len(loops) == 2  # the outer loop holds the first: not innermost
    assert loops[0][0] == "vmovaps (%rax),%zmm1" and loops[0][-1] == "jne 14"
    assert mca_model.pick(loops, "vfmadd") == loops[0]  # two FMAs against one
    assert mca_model.pick(loops, "vscalefps") == loops[1]
    assert mca_model.pick(loops, "tdpbf16ps") is None


def test_mca_source_branches_to_the_label():
    src = mca_model.mca_source(mca_model.innermost_loops(INSNS)[0])
    lines = src.splitlines()
    assert lines[0] == ".Lloop:" and lines[-1] == "jne .Lloop"
    assert "vbroadcastss (%rsi),%zmm2" in lines


@pytest.mark.skipif(not any(shutil.which(c) or os.path.exists(c) for c in mca_model.MCA_CANDIDATES),
                    reason="LLVM 19's llvm-mca is not installed (Debian: llvm-19)")
def test_model_on_known_loops():
    mca = mca_model.find_mca()
    # 24 independent FMAs: the peak loop itself, 12 cycles on two ports, 24 on Zen 4's one
    c, busy = mca_model.mca_cycles(mca, "skylake-avx512", mca_model.PEAK_LOOP)
    assert c == pytest.approx(12.0, abs=0.2) and busy
    c, _ = mca_model.mca_cycles(mca, "znver4", mca_model.PEAK_LOOP)
    assert c == pytest.approx(24.0, abs=0.3)
    # Zen 4: six memory broadcasts beside 24 FMAs cost nothing once modelled as loads
    body = mca_model.PEAK_LOOP + "".join(f"vbroadcastss {4 * i}(%rsi),%zmm{24 + i}\n" for i in range(6))
    c, _ = mca_model.mca_cycles(mca, "znver4", body)
    assert c == pytest.approx(24.0, abs=0.5)
