"""Run-time kernel choice: the kernels offered match what the CPU can do (read here
from /proc/cpuinfo or NumPy, not from fastattn), FASTATTN_DISABLE_CPU_FEATURES
forces a lower kernel (and, with AVX512_BF16, the float32 bfloat16 path), and
show_config says which kernel and which bfloat16 path run and why.

The expectations come from the CPU, never from fastattn._kernels.supported_kernels():
a build that lost its AVX kernels shrinks that list (and with it the `kernel` fixture
of every other test file), so a test comparing against it would pass."""
import os
import platform
import re
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import _kernels

SUPPORTED = _kernels.supported_kernels()
ORDER = ["generic", "avx2", "avx512", "neon", "sve256", "sve128"]  # lowest first, as supported_kernels() lists them

# What each kernel needs (docs: avx2 = AVX2 + FMA + F16C; avx512 = AVX512F on top; neon,
# on AArch64, Advanced SIMD and FP).
NEEDS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx2", "fma", "f16c"},
         "neon": {"fp", "asimd"}, "sve256": {"fp", "asimd", "sve", "sve-vl256"},
         "sve128": {"fp", "asimd", "sve", "sve-vl128"}}
# NumPy's names for the same features.
NUMPY_NAMES = {"avx2": "AVX2", "fma": "FMA3", "f16c": "F16C", "avx512f": "AVX512F"}
# FASTATTN_DISABLE_CPU_FEATURES's other name for a feature
ALIASES = {"neon": "asimd"}


def _proc_cpuinfo_flags():
    """The first "flags" line of /proc/cpuinfo (Linux lists only the features the
    kernel enabled, so the OS's part is included), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if re.match(r"flags\s*:", line):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def _proc_cpuinfo_vendor():
    """The first "vendor_id" of /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if re.match(r"vendor_id\s*:", line):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _intel_like():
    """Not an AMD CPU (Hygon's are AMD's design): vdpbf16ps at half the FMA rate."""
    return _proc_cpuinfo_vendor() not in ("AuthenticAMD", "HygonGenuine")


def _numpy_flags():
    """The same features from NumPy's own CPU detection (CPUID + XGETBV), or None."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as feats
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as feats
        except ImportError:
            return None
    return {ours for ours, theirs in NUMPY_NAMES.items() if feats.get(theirs)}


def _is_x86_64():
    return platform.machine().lower() in ("x86_64", "amd64")


def _is_aarch64():
    return platform.machine().lower() in ("aarch64", "arm64")


def _auxv_hwcap():
    """AArch64 Linux: the kernel's hardware capabilities, getauxval(AT_HWCAP) through the
    C library (bit 0 FP, bit 1 ASIMD, bit 22 SVE; under qemu-user, the emulated CPU's),
    AT_HWCAP2's bit 14 BF16 and bit 12 SVEBF16, and "sve-vl256" or "sve-vl128" where
    prctl(PR_SVE_GET_VL) gives 32 or 16 bytes; or None."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.getauxval.restype = ctypes.c_ulong
        libc.getauxval.argtypes = [ctypes.c_ulong]
        hw, hw2 = libc.getauxval(16), libc.getauxval(26)  # AT_HWCAP, AT_HWCAP2
        flags = {name for bit, name in ((0, "fp"), (1, "asimd"), (22, "sve")) if (hw >> bit) & 1}
        flags |= {name for bit, name in ((14, "bf16"), (12, "svebf16")) if (hw2 >> bit) & 1}
        vl = libc.prctl(51, 0, 0, 0, 0) & 0xFFFF if "sve" in flags else 0  # PR_SVE_GET_VL
        if vl in (32, 16):
            flags.add(f"sve-vl{8 * vl}")
    except (OSError, AttributeError):
        return None
    return flags


def _cpu_features():
    if _is_aarch64():  # (/proc/cpuinfo under qemu-user is the host's)
        flags = _auxv_hwcap()
        if flags is None:
            pytest.skip("getauxval is not available")
        return flags, "getauxval(AT_HWCAP)"
    flags = _proc_cpuinfo_flags()
    source = "/proc/cpuinfo"
    if flags is None:
        flags, source = _numpy_flags(), "numpy __cpu_features__"
    if flags is None:
        pytest.skip("neither /proc/cpuinfo nor numpy's __cpu_features__ is available")
    return flags, source


def _kernels_for(flags, disabled=""):
    """The kernels a CPU with `flags` runs (lowest first), with the features listed in
    `disabled` (FASTATTN_DISABLE_CPU_FEATURES syntax) turned off: disabling AVX512F,
    AVX2, FMA or F16C rules out avx512, disabling AVX2, FMA or F16C rules out avx2."""
    off = {f.lower() for f in re.split(r"[,\s]+", disabled) if f}
    off |= {ALIASES[f] for f in off if f in ALIASES}
    if _is_aarch64():
        return ["generic"] + [k for k in ("neon", "sve128", "sve256") if NEEDS[k] <= set(flags) - off]
    have = set(flags) - off if _is_x86_64() else set()
    return ["generic"] + [k for k in ("avx2", "avx512") if NEEDS[k] <= have]


def _in_subprocess(disabled):
    env = dict(os.environ, FASTATTN_DISABLE_CPU_FEATURES=disabled)
    code = ("import fastattn; fastattn.show_config(); from fastattn import _kernels; "
            "print(_kernels.kernel_reason()); print(_kernels.bf16_path()); print(_kernels.current_kernel())")
    # from a neutral directory, so the child imports the fastattn this process
    # tests, never a source tree in the working directory
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__))))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()


def test_every_kernel_the_cpu_supports_is_offered():
    """A kernel that this CPU (and OS) can run is missing from supported_kernels():
    a build without its SIMD kernels, or a broken CPU check."""
    flags, source = _cpu_features()
    want = _kernels_for(flags)
    missing = [k for k in want if k not in SUPPORTED]
    assert not missing, (f"the CPU has {sorted(flags & set(NUMPY_NAMES))} (from {source}), so "
                         f"fastattn should run {want}; supported_kernels() is {SUPPORTED} "
                         f"(missing {missing})")
    extra = [k for k in SUPPORTED if k not in want]
    assert not extra, (f"supported_kernels() offers {extra}, which this CPU cannot run "
                       f"(features {sorted(flags & set(NUMPY_NAMES))} from {source})")
    assert SUPPORTED == [k for k in ORDER if k in SUPPORTED]  # lowest first


def test_cpu_feature_sources_agree():
    """/proc/cpuinfo and NumPy agree on the four features (where both are there), so
    neither source can hide a kernel from the test above."""
    proc, npy = _proc_cpuinfo_flags(), _numpy_flags()
    if not _is_x86_64():
        pytest.skip("x86-64's four features only")
    if proc is None or npy is None:
        pytest.skip("only one source of CPU features here")
    assert proc & set(NUMPY_NAMES) == npy


def test_every_offered_kernel_runs():
    """Each kernel the CPU supports can be selected and computes: set_kernel, the
    kernel's own exp, and an attention call that matches the oracle."""
    flags, _ = _cpu_features()
    x = np.linspace(-30.0, 5.0, 101)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 19, 16)).astype(np.float32)
    k = rng.standard_normal((2, 70, 16)).astype(np.float32)
    ref = fastattn.reference.attention(q, k, k, causal=True)
    before = _kernels.current_kernel()
    try:
        for name in _kernels_for(flags):
            np.testing.assert_allclose(_kernels.exp(x.astype(np.float32), name), np.exp(x),
                                       rtol=1e-5, atol=0)
            _kernels.set_kernel(name)
            assert _kernels.current_kernel() == name
            out = fastattn.attention(q, k, k, causal=True)
            assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()
    finally:
        _kernels.set_kernel(before)


def test_x86_64_build_has_its_simd_kernels():
    """On x86-64 the build includes the AVX2/AVX-512 kernels (setup.py adds them
    whenever it builds for x86-64): the kernel choice never says the build lacks them."""
    ext = os.path.basename(_kernels.__file__)
    if not (_is_x86_64() or "x86_64" in ext or "amd64" in ext.lower()):
        pytest.skip(f"not an x86-64 build ({platform.machine()}, {ext})")
    # AVX2 disabled: the reason names the switch (or the CPU), never the build
    lines = _in_subprocess("AVX2")
    assert not any("no x86 SIMD kernels" in ln for ln in lines), lines
    lines = _in_subprocess("")
    assert not any("no x86 SIMD kernels" in ln for ln in lines), lines


def test_aarch64_build_has_its_neon_kernel():
    """On AArch64 the build includes the NEON kernel (setup.py adds it whenever it builds
    for aarch64), and disabling NEON leaves the portable kernel with the switch named."""
    if not _is_aarch64():
        pytest.skip(f"not an AArch64 build ({platform.machine()})")
    assert "neon" in SUPPORTED
    lines = _in_subprocess("SVE")
    assert lines[-1] == "neon" and any("Advanced SIMD" in ln for ln in lines), lines
    lines = _in_subprocess("NEON")
    assert lines[-1] == "generic" and any("NEON disabled by FASTATTN_DISABLE_CPU_FEATURES" in ln
                                          for ln in lines), lines


def test_generic_always_available():
    assert SUPPORTED[0] == "generic"


def test_best_kernel_chosen_by_default():
    flags, _ = _cpu_features()
    lines = _in_subprocess("")
    assert lines[-1] == _kernels_for(flags)[-1]
    assert lines[-1] == SUPPORTED[-1]


@pytest.mark.parametrize("disabled", [
    "AVX512F", "avx512f", "AVX512F,AVX2", "AVX2", "FMA", "F16C", "f16c", "SSE3, AVX512F", "", "SSE3",
    "NEON", "neon", "ASIMD", "AVX2,NEON", "SVE", "sve,AVX512F",
])
def test_disable_features(disabled):
    """FASTATTN_DISABLE_CPU_FEATURES picks the best kernel the CPU has without the
    listed features (expected from the CPU's flags, not from fastattn)."""
    flags, _ = _cpu_features()
    want = _kernels_for(flags, disabled)[-1]
    lines = _in_subprocess(disabled)
    assert lines[-1] == want, lines
    assert any(f"kernel:   {want}" in ln for ln in lines), lines


def test_set_kernel_rejects_unknown():
    with pytest.raises(ValueError, match="unknown kernel"):
        _kernels.set_kernel("sse9")


def test_show_config_mentions_kernel(capsys):
    fastattn.show_config()
    out = capsys.readouterr().out
    assert "kernel:" in out and _kernels.current_kernel() in out and "openmp" in out


def _bf16_path_for(flags, disabled=""):
    """The bfloat16 path a CPU with `flags` takes: AVX512-BF16 pairs need the avx512
    kernel, AVX512BW and AVX512-BF16 (in the emulated test build, the avx2 kernel's
    features), and none of them disabled (AVX512_BF16 in the list turns the pairs off,
    and the AMX tiles with them); the AMX tiles all that, AMX-TILE and AMX-BF16, a build
    with the AMX kernel, Linux's permission for the tile data, and AMX not disabled.
    The emulated build starts on the pairs (its tiles are a slow software model).  A
    real build never starts on the pairs on a CPU that is not AMD's (Hygon's are AMD's
    design): Intel's vdpbf16ps runs at half the float32 FMA rate, so there the path is
    the AMX tiles or float32.  AArch64: BFDOT pairs where the build has them, the CPU
    reports BF16 (SVEBF16 too for an SVE kernel), the kernel that runs is neon, sve256 or
    sve128, and BF16 is not disabled."""
    off = {f.lower() for f in re.split(r"[,\s]+", disabled) if f}
    if _is_aarch64():
        kern = _kernels_for(flags, disabled)[-1]
        ok = ("bfdot" in _kernels.bf16_paths_built() and "bf16" in flags and "bf16" not in off and
              (kern == "neon" or (kern.startswith("sve") and "svebf16" in flags)))
        return "bfdot" if ok else "float32"
    if _kernels.bf16_emulated():  # over SIMDe, from the avx2 kernel up
        ok = _kernels_for(flags, disabled)[-1] in ("avx2", "avx512")
        amx = False
    else:
        ok = _kernels_for(flags, disabled)[-1] == "avx512" and {"avx512bw", "avx512_bf16"} <= set(flags)
        amx = ({"amx_tile", "amx_bf16"} <= set(flags) and "amx-bf16" in _kernels.bf16_paths_built()
               and not _kernels.build_info()["bf16_amx_refused"] and not off & {"amx", "amx_bf16", "amx_tile"})
    if not (ok and "avx512_bf16" not in off and _is_x86_64()):
        return "float32"
    if amx:
        return "amx-bf16"
    if not _kernels.bf16_emulated() and _intel_like():
        return "float32"
    return "avx512-bf16"


@pytest.mark.parametrize("disabled", ["", "AVX512_BF16", "avx512_bf16, SSE3", "AVX512F", "AVX2", "AMX",
                                      "amx_bf16", "BF16", "sve", "NEON", "bf16,SVE"])
def test_bf16_path_follows_the_cpu(disabled):
    """The bfloat16 path (expected from the CPU's flags, not from fastattn), and
    show_config's line naming it."""
    flags, source = _cpu_features()
    if not _is_aarch64() and _proc_cpuinfo_flags() is None:
        pytest.skip("AVX512-BF16 is read from /proc/cpuinfo here, which this system lacks")
    want = _bf16_path_for(flags, disabled)
    lines = _in_subprocess(disabled)
    assert lines[-2] == want, (lines, sorted(flags & {"avx512bw", "avx512_bf16", "bf16", "svebf16"}))
    bf = [ln for ln in lines if ln.strip().startswith("bfloat16:")]
    assert bf and (("takes both products on AVX512-BF16 pairs" in bf[0]) == (want == "avx512-bf16")), bf
    assert ("on AMX tiles" in bf[0]) == (want == "amx-bf16"), bf
    assert ("takes both products on BFDOT pairs" in bf[0]) == (want == "bfdot"), bf
    if want == "bfdot":  # the kernel that runs, and its BFDOT kernel
        assert f"({lines[-1]}-bfdot:" in bf[0], bf
    if want == "amx-bf16":  # the backward's products: the tiles too
        assert "the backward on AMX tiles too" in bf[0], bf
    assert _kernels.build_info()["bf16_pairs_slow"] == ("avx512_bf16" in flags and _intel_like())


def test_bf16_paths_built_and_run():
    """Every path that runs was built; the emulated build builds both products' paths
    and runs them from the avx2 kernel up; a real build runs the AMX tiles only where
    /proc/cpuinfo shows AMX-TILE and AMX-BF16, and BFDOT (AArch64) where getauxval shows
    BF16."""
    built, runs = _kernels.bf16_paths_built(), _kernels.bf16_paths()
    assert set(runs) <= set(built) and built[0] == runs[0] == "float32"
    flags = _proc_cpuinfo_flags()
    if _kernels.bf16_emulated():
        assert built == ["float32", "avx512-bf16", "amx-bf16"] and _kernels.amx_model_ops() >= 0
        if "avx2" in SUPPORTED:
            assert runs == built
    else:
        assert _kernels.amx_model_ops() == -1
        if flags is not None and "amx-bf16" in runs:
            assert {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags)
    if _is_aarch64():  # BFDOT runs where it is built and the CPU reports BF16
        hw = _auxv_hwcap()
        if hw is not None:
            assert ("bfdot" in runs) == ("bfdot" in built and "bf16" in hw and "asimd" in hw), (runs, built, hw)
        assert not {"avx512-bf16", "amx-bf16"} & set(built)
