"""Build of fastattn's one extension, ``fastattn._kernels``.

The C kernels in src_c/ and the Cython wrapper are linked into one shared object.
Each SIMD kernel file is compiled with its own instruction-set flags and nothing
else (never -march=native); cpu.c picks one at import.  OpenMP is detected by
compiling and running a test program; without it the build falls back to a serial
kernel with a warning, or fails if FASTATTN_REQUIRE_OPENMP=1 (set in CI).
"""
import functools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings

import numpy as np
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SRC = "src_c"
# -g0: no debug information in what we ship (Python's own CFLAGS carry -g, which made
# the extension 6 MB); the link strips what is left.
COMMON_C = ["-O3", "-g0", "-std=gnu11", "-fno-math-errno", "-Wall", "-Wno-unknown-pragmas"]
STRIP_LINK = ["-Wl,--strip-debug"] if platform.system() == "Linux" else []
# A sanitized build (.ci/sanitize passes -fsanitize=... in CFLAGS) is for finding bugs,
# not for shipping: -O1 as the sanitizers advise (-O3 takes minutes a file under ASan)
# and debug information, so that each report names the file and line.
if "-fsanitize" in os.environ.get("CFLAGS", ""):
    COMMON_C = ["-O1", "-g"] + COMMON_C[2:]
    STRIP_LINK = []
# The SIMD files without Python's -fwrapv (in its CFLAGS, which the extension inherits):
# under it GCC 12 kept accumulators of the one-row decode kernels (int8, int4, 16-bit K)
# on the stack, loaded, FMA'd and stored at every feature (signed overflow is a bug there anyway:
# .ci/sanitize's UBSan build would report it).
KERNEL_C = ["-fno-wrapv"]
# Per-file instruction-set flags: only these files get them.
SIMD_FILES = {
    "kernels_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "kernels_avx512.c": ["-mavx512f", "-mavx2", "-mfma", "-mf16c"],
}
# The bfloat16 products (vdpbf16ps), where the compiler knows the instruction; cpu.c
# runs them only on CPUs that have it.  FASTATTN_EMULATE_BF16=1 builds them for tests
# over SIMDe instead (libsimde-dev; AVX2 flags only): the same source on any AVX2 CPU.
BF16_FILE = "kernels_avx512bf16.c"
BF16_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"]
EMULATE_BF16 = os.environ.get("FASTATTN_EMULATE_BF16", "") not in ("", "0")
BF16_PROBE = r"""
#include <immintrin.h>
__m512 f(__m512 a, __m512bh b, __m512bh c) { return _mm512_dpbf16_ps(a, b, c); }
__m512bh g(__m512 a, __m512 b) { return _mm512_cvtne2ps_pbh(a, b); }
"""
# The AMX tiles (tdpbf16ps), where the compiler knows them (gcc 11+, clang 12+); cpu.c
# runs them only where CPUID, the OS and Linux's permission allow.  Under
# FASTATTN_EMULATE_BF16=1 the same file is built over SIMDe with a software model of
# the tiles (src_c/amx_model.h; AVX2 flags only).
AMX_FILE = "kernels_amx.c"
AMX_FLAGS = BF16_FLAGS + ["-mavx512dq", "-mamx-tile", "-mamx-bf16"]  # (DQ: vreduceps in its softmax)
AMX_PROBE = r"""
#include <immintrin.h>
void f(const void *cfg, const void *a, const void *b, void *c) {
    _tile_loadconfig(cfg);
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b, 64);
    _tile_zero(0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_stored(0, c, 64);
    _tile_release();
}
"""
# AArch64: the NEON kernel, with the baseline's flags (NEON and its float16 conversions
# are part of every AArch64 CPU).
ARM64_FILES = {"kernels_neon.c": ["-march=armv8-a"]}
# SVE at 256 bits (Graviton 3) and at 128 bits (Graviton 4, Grace, Axion), one build of
# kernels_sve.h per length, where the compiler knows SVE's fixed-length types (gcc 10+,
# clang 12+); cpu.c runs each only on CPUs with SVE at its vector length.  Not on macOS
# (no Apple CPU has SVE).
SVE_FILES = {f"kernels_sve{bits}.c": ["-march=armv8.2-a+sve", f"-msve-vector-bits={bits}"]
             for bits in (256, 128)}
SVE_PROBE_FLAGS = SVE_FILES["kernels_sve256.c"]
# The bfloat16 pair products (BFDOT) of each AArch64 kernel, its own flags and +bf16
# (gcc 10+, clang 11+); cpu.c runs each where the CPU reports FEAT_BF16 (SVE's too for
# the SVE ones) and its float32 kernel runs.
ARM_BF16_FILES = {"kernels_neon_bf16.c": ["-march=armv8.2-a+bf16"]}
SVE_BF16_FILES = {f"kernels_sve{bits}_bf16.c": ["-march=armv8.2-a+sve+bf16", f"-msve-vector-bits={bits}"]
                  for bits in (256, 128)}
ARM_BF16_PROBE = r"""
#include <arm_neon.h>
float32x4_t f(float32x4_t a, bfloat16x8_t b, bfloat16x8_t c) { return vbfdotq_f32(a, b, c); }
bfloat16x4_t g(float32x4_t a) { return vcvt_bf16_f32(a); }
"""
SVE_BF16_PROBE = r"""
#include <arm_sve.h>
svfloat32_t f(svfloat32_t a, svbfloat16_t b, svbfloat16_t c) { return svbfdot_f32(a, b, c); }
"""
SVE_PROBE = r"""
#include <arm_sve.h>
typedef svfloat32_t v8 __attribute__((arm_sve_vector_bits(256)));
v8 f(v8 a, v8 b) { v8 t[2] = {a, b}; return svmla_f32_x(svptrue_b32(), t[0], t[1], b); }
"""


@functools.lru_cache(maxsize=None)
def _target(cc):
    """The machine the compiler builds for: `cc -dumpmachine`'s first field (a cross
    compiler's target, e.g. aarch64-linux-gnu-gcc's), else this interpreter's machine."""
    try:
        r = subprocess.run([*cc, "-dumpmachine"], capture_output=True, text=True, timeout=60)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().split("-")[0].lower()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return platform.machine().lower()
# The XLA FFI handlers of fastattn.jax (a C++17 file compiled against the headers jaxlib
# ships), built when jax is found in the build environment or in the environment being
# installed into.  FASTATTN_JAX_FFI=0 skips them; FASTATTN_JAX_FFI=1 requires them: where
# neither environment has jax, JAX_BUILD_REQUIRES goes into the build environment (a
# PEP 517 frontend such as pip or `python -m build` installs it there), and a build
# without the handlers fails.  (pip keeps the wheels it builds from an sdist, and the
# variable is no part of that cache's key: with pip, add --no-cache-dir.)  The handlers
# hold no code of jaxlib and need nothing of it at run time.  XLA promises to accept handlers compiled against older FFI headers than
# its own for at least 12 months (xla/ffi/api/c_api.h) and promises nothing for newer
# ones: hence the oldest jax the `jax` extra allows.
JAX_FILE = "jax_ffi.cc"
JAX_FLAGS = ["-O2", "-g0", "-std=c++17", "-fno-math-errno", "-Wall", "-fvisibility=hidden"]
JAX_PROBE = "import jax.ffi; print(jax.ffi.include_dir())"
JAX_MODE = os.environ.get("FASTATTN_JAX_FFI", "")
JAX_BUILD_REQUIRES = ["jax==0.10.2"]
# Every header a C file may include (a change to one rebuilds them all).
HEADERS = sorted(os.path.basename(h) for h in os.listdir(SRC) if h.endswith(".h"))

OPENMP_TEST = r"""
#include <omp.h>
#include <stdio.h>
int main(void) {
    int n = 0;
#pragma omp parallel reduction(+ : n)
    n += 1;
    printf("%d %d\n", n, (int)_OPENMP);
    return n >= 1 ? 0 : 1;
}
"""


def _libomp_flag_sets():
    """Apple's clang has no -fopenmp of its own: with LLVM's OpenMP runtime (Homebrew's
    `libomp`, or the prefix named by FASTATTN_LIBOMP, holding include/omp.h and
    lib/libomp.*) it takes the pragmas through its preprocessor and the library by name.
    One (compile flags, link flags) pair for each such prefix that exists."""
    prefixes = [os.environ["FASTATTN_LIBOMP"]] if os.environ.get("FASTATTN_LIBOMP") else []
    if platform.system() == "Darwin":
        try:
            r = subprocess.run(["brew", "--prefix", "libomp"], capture_output=True, text=True, timeout=60)
            if r.returncode == 0 and r.stdout.strip():
                prefixes.append(r.stdout.strip())
        except (OSError, subprocess.TimeoutExpired):
            pass
        prefixes += ["/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"]
    sets = []
    for prefix in dict.fromkeys(prefixes):
        inc, lib = os.path.join(prefix, "include"), os.path.join(prefix, "lib")
        if os.path.isfile(os.path.join(inc, "omp.h")):
            sets.append((["-Xpreprocessor", "-fopenmp", f"-I{inc}"],
                         [f"-L{lib}", "-lomp", f"-Wl,-rpath,{lib}"]))
    return sets


@functools.lru_cache(maxsize=None)
def _jax_include():
    """jaxlib's FFI headers, or None: looked for in the build environment (this
    interpreter with its environment variables, which is how pip's build isolation
    adds the build requirements), then in the environment fastattn is being installed
    into (this interpreter in isolated mode, -I: its own site-packages without the
    isolated build environment)."""
    if JAX_MODE == "0":
        return None
    for isolated in ([], ["-I"]):
        try:
            r = subprocess.run([sys.executable, *isolated, "-c", JAX_PROBE], capture_output=True,
                               text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            continue
        inc = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else ""
        if inc and os.path.isfile(os.path.join(inc, "xla", "ffi", "api", "ffi.h")):
            return inc
    return None


def _compiler_cmd(compiler):
    cc = getattr(compiler, "compiler_so", None) or [os.environ.get("CC", "cc")]
    return list(cc)


def _try_compile_run(compiler, source, flags):
    """Compile `source` with `flags`, link, run; True if it ran and exited 0."""
    tmp = tempfile.mkdtemp(prefix="fastattn-probe-")
    try:
        src = os.path.join(tmp, "probe.c")
        exe = os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(source)
        cmd = [c for c in _compiler_cmd(compiler) if c not in ("-fPIC",)]
        r = subprocess.run(cmd + [src, "-o", exe] + flags, capture_output=True, text=True)
        if r.returncode != 0:
            return False
        return subprocess.run([exe], capture_output=True, text=True).returncode == 0
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _try_compile(compiler, source, flags):
    """Does `source` compile to an object file with `flags`?"""
    tmp = tempfile.mkdtemp(prefix="fastattn-probe-")
    try:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(source)
        cmd = [c for c in _compiler_cmd(compiler) if c not in ("-fPIC",)]
        return subprocess.run(cmd + ["-c", src, "-o", os.path.join(tmp, "probe.o")] + flags,
                              capture_output=True, text=True).returncode == 0
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _submit_compile(compiler, pool, sources, output_dir=None, macros=None, include_dirs=None,
                    debug=0, extra_preargs=None, extra_postargs=None, depends=None):
    """compiler.compile's steps, each source's compiler process submitted to `pool`:
    returns the object files and the futures of the compiles."""
    macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs)
    cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
    futures = [pool.submit(compiler._compile, obj, build[obj][0], build[obj][1], cc_args,
                           extra_postargs, pp_opts) for obj in objects if obj in build]
    return objects, futures


def _can_submit(compiler):
    return all(hasattr(compiler, s) for s in ("_setup_compile", "_get_cc_args", "_compile"))


class BuildExt(build_ext):
    def build_extension(self, ext):
        ext.extra_compile_args = list(COMMON_C)
        ext.extra_link_args = list(STRIP_LINK)
        ext.define_macros = list(ext.define_macros or [])

        # OpenMP's (compile flags, link flags): -fopenmp, else (Apple's clang) libomp's
        omp = (["-fopenmp"], ["-fopenmp"])
        if not _try_compile_run(self.compiler, OPENMP_TEST, omp[0]):
            omp = next((fl for fl in _libomp_flag_sets()
                        if _try_compile_run(self.compiler, OPENMP_TEST, fl[0] + fl[1])), None)
        if omp:
            ext.extra_compile_args += omp[0]
            ext.extra_link_args += omp[1]
            print(f"fastattn: OpenMP found ({' '.join(dict.fromkeys(omp[0] + omp[1]))})")
        else:
            msg = ("fastattn: OpenMP not found (a test program with -fopenmp, or with libomp's "
                   "-Xpreprocessor -fopenmp -lomp where FASTATTN_LIBOMP or Homebrew names it, did "
                   "not compile and run); building the serial kernel")
            if os.environ.get("FASTATTN_REQUIRE_OPENMP", "") not in ("", "0"):
                raise RuntimeError(msg + " and FASTATTN_REQUIRE_OPENMP is set")
            warnings.warn(msg)

        target = _target(tuple(_compiler_cmd(self.compiler)))
        is_x86 = target in ("x86_64", "amd64")
        simd = dict(SIMD_FILES) if is_x86 else {}
        if target in ("aarch64", "arm64"):
            simd.update(ARM64_FILES)
            ext.define_macros.append(("FA_HAVE_NEON_KERNELS", "1"))
            print(f"fastattn: building for {target}: the NEON kernel")
            sve = False
            if platform.system() == "Darwin":
                pass  # (no Apple CPU has SVE)
            elif _try_compile(self.compiler, SVE_PROBE, SVE_PROBE_FLAGS):
                simd.update({f: list(flags) for f, flags in SVE_FILES.items()})
                ext.define_macros.append(("FA_HAVE_SVE_KERNELS", "1"))
                sve = True
                print("fastattn: and the SVE kernels for 256-bit and 128-bit vector lengths")
            else:
                print("fastattn: the compiler has no -msve-vector-bits; no SVE kernel")
            if _try_compile(self.compiler, ARM_BF16_PROBE, ARM_BF16_FILES["kernels_neon_bf16.c"]) and (
                    not sve or _try_compile(self.compiler, SVE_BF16_PROBE, SVE_BF16_FILES["kernels_sve256_bf16.c"])):
                simd.update({f: list(flags) for f, flags in ARM_BF16_FILES.items()})
                if sve:
                    simd.update({f: list(flags) for f, flags in SVE_BF16_FILES.items()})
                ext.define_macros.append(("FA_HAVE_ARM_BF16_KERNELS", "1"))
                print("fastattn: and their bfloat16 products on BFDOT")
            else:
                print("fastattn: the compiler has no +bf16; bfloat16 computes in float32")
        if is_x86:
            ext.define_macros.append(("FA_HAVE_X86_KERNELS", "1"))
            if EMULATE_BF16:
                simd[BF16_FILE] = ["-mavx2", "-mfma", "-mf16c"]
                simd[AMX_FILE] = ["-mavx2", "-mfma", "-mf16c"]
                ext.define_macros += [("FA_HAVE_BF16_KERNELS", "1"), ("FA_EMULATE_BF16", "1"),
                                      ("FA_HAVE_AMX_KERNELS", "1"), ("FA_EMULATE_AMX", "1")]
                print("fastattn: the bfloat16 products emulated by SIMDe and the AMX tiles by a "
                      "software model (a test build)")
            elif _try_compile(self.compiler, BF16_PROBE, BF16_FLAGS):
                simd[BF16_FILE] = list(BF16_FLAGS)
                ext.define_macros.append(("FA_HAVE_BF16_KERNELS", "1"))
                if _try_compile(self.compiler, AMX_PROBE, AMX_FLAGS):
                    simd[AMX_FILE] = list(AMX_FLAGS)
                    ext.define_macros.append(("FA_HAVE_AMX_KERNELS", "1"))
                else:
                    print("fastattn: the compiler has no -mamx-tile/-mamx-bf16; no AMX kernel")
            else:
                print("fastattn: the compiler has no -mavx512bf16; bfloat16 computes in float32")
        jax_inc = _jax_include()
        if jax_inc:
            simd[JAX_FILE] = JAX_FLAGS + ["-isystem", jax_inc]  # (its warnings are not ours)
            ext.define_macros.append(("FA_HAVE_JAX_FFI", "1"))
            ext.extra_link_args.append("-lstdc++")
            print(f"fastattn: the JAX FFI handlers (fastattn.jax) against {jax_inc}")
        elif JAX_MODE == "1":
            raise RuntimeError("fastattn: FASTATTN_JAX_FFI=1 but no jaxlib FFI headers were "
                               "found (jax.ffi.include_dir()) in the build environment or "
                               "the target environment")
        else:
            print("fastattn: jax is not installed in this environment: no JAX FFI handlers "
                  "(fastattn.jax needs them; install jax first, then fastattn, or build "
                  "with FASTATTN_JAX_FFI=1)")

        def simd_args(name, flags):  # one SIMD file, with its own flags only
            return dict(sources=[os.path.join(SRC, name)], output_dir=self.build_temp,
                        macros=ext.define_macros, include_dirs=ext.include_dirs,
                        extra_postargs=(flags if name == JAX_FILE else COMMON_C + KERNEL_C + flags),
                        depends=[os.path.join(SRC, h) for h in HEADERS] +
                        ([os.path.join(SRC, "kernels_neon.c")] if name == "kernels_neon_bf16.c" else []))
        ext.extra_objects = list(ext.extra_objects or [])
        # the separately compiled files are the extension's too: a change to one relinks it
        ext.depends = list(ext.depends) + [os.path.join(SRC, n) for n in simd
                                           if os.path.join(SRC, n) not in ext.depends]
        jobs = min(os.cpu_count() or 1, 8)
        if jobs < 2 or not _can_submit(self.compiler):  # one compiler process at a time
            for name, flags in simd.items():
                ext.extra_objects += self.compiler.compile(**simd_args(name, flags))
            super().build_extension(ext)
            return
        # As make -j would: one compiler process per source, `jobs` at a time, in one
        # queue.  The SIMD files (each with its own flags; the avx512 one alone takes
        # half of a serial build) are queued first, the other sources behind them, and
        # the link waits for all of them.
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(jobs)
        pending = []
        for name, flags in simd.items():
            objs, futs = _submit_compile(self.compiler, pool, **simd_args(name, flags))
            ext.extra_objects += objs
            pending += futs
        compile_one_by_one, link = self.compiler.compile, self.compiler.link

        def compile(sources, **kwargs):
            objs, futs = _submit_compile(self.compiler, pool, sources, **kwargs)
            for f in futs:
                f.result()
            return objs

        def link_when_compiled(*args, **kwargs):
            for f in pending:
                f.result()  # a failed compile raises here, before the link
            return link(*args, **kwargs)
        self.compiler.compile, self.compiler.link = compile, link_when_compiled
        try:
            super().build_extension(ext)
            for f in pending:
                f.result()
        finally:
            pool.shutdown(wait=True)
            self.compiler.compile, self.compiler.link = compile_one_by_one, link


ext = Extension(
    "fastattn._kernels",
    sources=[
        "fastattn/_kernels.pyx",
        *(os.path.join(SRC, f) for f in ("fa_common.c", "fa_plan.c", "fa_forward.c", "fa_backward.c",
                                          "fa_mass.c")),
        os.path.join(SRC, "cpu.c"),
        os.path.join(SRC, "kernels_generic.c"),
    ],
    include_dirs=[np.get_include(), SRC],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    depends=[os.path.join(SRC, h) for h in HEADERS],
)

from Cython.Build import cythonize  # noqa: E402

setup(
    # The generated _kernels.c goes to build/, not beside the .pyx: it is a build
    # product, and a copy inside fastattn/ would ship in the wheel.
    ext_modules=cythonize([ext], compiler_directives={"language_level": 3},
                          build_dir=os.path.join("build", "cython")),
    cmdclass={"build_ext": BuildExt},
    # Asked of setup.py by the build backend (setuptools.build_meta's
    # get_requires_for_build_wheel): jax for the handlers only where it was asked for
    # and neither environment has it.
    setup_requires=(JAX_BUILD_REQUIRES if JAX_MODE == "1" and _jax_include() is None else []),
)
