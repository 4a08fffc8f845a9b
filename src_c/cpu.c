/*
 * cpu.c -- picks the micro-kernels once, at import, from what the CPU reports
 * (CPUID) and what the operating system saves on a context switch (XGETBV): a CPU
 * with AVX-512 under an OS that does not save the zmm registers must not run them.
 */
#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include "fa_internal.h"

#if defined(FA_HAVE_X86_KERNELS) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#define FA_X86 1
#endif
#if defined(FA_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(FA_HAVE_NEON_KERNELS) && defined(__aarch64__)
#define FA_ARM64 1
#if defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#endif

static const char *const fa_isa_names[FA_ISA_COUNT] = {"generic", "avx2", "avx512", "neon", "sve256",
                                                           "sve128"};

const char *fa_isa_name(int isa)
{
    return (isa >= 0 && isa < FA_ISA_COUNT) ? fa_isa_names[isa] : "unknown";
}

const fa_kernel *fa_kernel_for_isa(int isa)
{
    switch (isa) {
    case FA_ISA_GENERIC: return &fa_kernel_generic;
#ifdef FA_HAVE_X86_KERNELS
    case FA_ISA_AVX2: return &fa_kernel_avx2;
    case FA_ISA_AVX512: return &fa_kernel_avx512;
#endif
#ifdef FA_HAVE_NEON_KERNELS
    case FA_ISA_NEON: return &fa_kernel_neon;
#endif
#ifdef FA_HAVE_SVE_KERNELS
    case FA_ISA_SVE256: return &fa_kernel_sve256;
    case FA_ISA_SVE128: return &fa_kernel_sve128;
#endif
    default: return NULL;
    }
}

#ifdef FA_X86
static uint64_t fa_xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

#ifdef FA_ARM64
/* Advanced SIMD with its float16 conversions: Linux's hardware capabilities (AT_HWCAP:
 * FP, bit 0, and ASIMD, bit 1), macOS's sysctl hw.optional.AdvSIMD; every AArch64 CPU
 * that runs either has them, and elsewhere the ABI promises them. */
static int fa_arm_neon(void)
{
#if defined(__linux__)
    const unsigned long hw = getauxval(AT_HWCAP);
    return (hw & 3ul) == 3ul;
#elif defined(__APPLE__)
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname("hw.optional.AdvSIMD", &v, &n, NULL, 0) != 0 || v != 0;
#else
    return 1;
#endif
}

/* The SVE vector length in bytes where an SVE kernel is built for it (32: sve256, 16:
 * sve128), else 0: Linux's AT_HWCAP bit 22 (SVE) and the process's vector length,
 * PR_SVE_GET_VL's low 16 bits (a process may change it, but not while fastattn's threads
 * run).  Elsewhere 0. */
static int fa_arm_sve_vl(void)
{
#if defined(__linux__) && defined(FA_HAVE_SVE_KERNELS)
#ifndef PR_SVE_GET_VL
#define PR_SVE_GET_VL 51
#endif
    if (!((getauxval(AT_HWCAP) >> 22) & 1ul)) return 0;
    const int vl = prctl(PR_SVE_GET_VL, 0, 0, 0, 0);
    return (vl >= 0 && ((vl & 0xffff) == 32 || (vl & 0xffff) == 16)) ? (vl & 0xffff) : 0;
#else
    return 0;
#endif
}
#endif

unsigned fa_cpu_supported_isas(void)
{
    unsigned isas = 1u << FA_ISA_GENERIC;
#ifdef FA_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return isas;
    int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return isas;
    uint64_t xcr0 = fa_xgetbv0();
    int os_ymm = (xcr0 & 0x6) == 0x6;    /* XMM and YMM state saved       */
    int os_zmm = (xcr0 & 0xE6) == 0xE6;  /* + opmask, ZMM_Hi256, Hi16_ZMM */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return isas;
    int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1;
    if (os_ymm && avx2 && fma && f16c) isas |= 1u << FA_ISA_AVX2;
    if (os_zmm && avx512f && avx2 && fma && f16c) isas |= 1u << FA_ISA_AVX512;
#endif
#ifdef FA_ARM64
    if (fa_arm_neon()) {
        isas |= 1u << FA_ISA_NEON;
        const int vl = fa_arm_sve_vl();
        if (vl == 32) isas |= 1u << FA_ISA_SVE256;
        if (vl == 16) isas |= 1u << FA_ISA_SVE128;
    }
#endif
    return isas;
}

/* Linux gives a process the AMX tile data (a large, dynamically enabled XSAVE state)
 * only on request: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once, at
 * import, for the whole process; a refusal (another OS, an old kernel, a seccomp
 * policy) leaves the tiles unused.  1 granted, 0 refused. */
#ifdef FA_X86
static int fa_amx_granted = -1;
static int fa_amx_permission(void)
{
    if (fa_amx_granted < 0) {
#if defined(FA_X86) && defined(__linux__) && defined(SYS_arch_prctl)
        const long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        unsigned long bits = 0;
        int ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        ok = ok && syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 && ((bits >> XFEATURE_XTILEDATA) & 1);
        fa_amx_granted = ok;
#else
        fa_amx_granted = 0;
#endif
    }
    return fa_amx_granted;
}
#endif

/* The CPU's bfloat16 instructions (fastattn.h): bit 0 AVX512-BF16 (CPUID 7.1 EAX 5);
 * bit 1 AMX-BF16 with AMX-TILE (CPUID 7.0 EDX 22 and 24), the tile configuration and
 * data saved by the OS (XCR0 bits 17 and 18) and the process's permission; bit 2 the
 * same but the permission refused; bit 3 AVX512-BF16 on a CPU that is not AMD's: on
 * Intel's cores vdpbf16ps issues once a cycle on one port, half the float32 FMA rate
 * (measured on a Sapphire Rapids-class Xeon: 123 against 247 GFLOP/s a core), where
 * AMD's Zen 4/5 run it at twice that rate.  Read once (CPUID traps to the hypervisor
 * in a VM: microseconds).  AArch64: bit 4 FEAT_BF16 (BFDOT and BFCVTN on Advanced
 * SIMD: Linux's AT_HWCAP2 bit 14, BF16; macOS's hw.optional.arm.FEAT_BF16), bit 5 SVE's
 * bfloat16 instructions as well (AT_HWCAP2 bit 12, SVEBF16). */
static unsigned fa_bf16_features_read(void)
{
    unsigned f = 0;
#ifdef FA_ARM64
#if defined(__linux__)
    const unsigned long hw2 = getauxval(AT_HWCAP2);
    if ((hw2 >> 14) & 1ul) f |= 16;
    if ((f & 16) && ((hw2 >> 12) & 1ul)) f |= 32;
#elif defined(__APPLE__)
    int v = 0;
    size_t n = sizeof v;
    if (sysctlbyname("hw.optional.arm.FEAT_BF16", &v, &n, NULL, 0) == 0 && v) f |= 16;
#endif
#endif
#ifdef FA_X86
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, NULL) >= 7 && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1)) f |= 1;
    if (__get_cpuid_max(0, NULL) >= 7 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) &&
        ((d >> 24) & 1) && __get_cpuid(1, &a, &b, &c, &d) && ((c >> 27) & 1) &&
        (fa_xgetbv0() & 0x60000) == 0x60000)
        f |= fa_amx_permission() ? 2u : 4u;
    if ((f & 1) && !fa_cpu_amd()) f |= 8;
#endif
    return f;
}

unsigned fa_cpu_bf16_features(void)
{
    static unsigned cached = ~0u; /* (the same value from every thread) */
    unsigned f = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (f == ~0u) {
        f = fa_bf16_features_read();
        __atomic_store_n(&cached, f, __ATOMIC_RELAXED);
    }
    return f;
}

/* ---- the bfloat16 path (fastattn.h) ---- */
static const char *const fa_bf16_names[FA_BF16_COUNT] = {"float32", "avx512-bf16", "amx-bf16", "bfdot"};

#ifndef FA_EMULATE_AMX
long fa_amx_model_ops(void) { return -1; } /* (kernels_amx.c in the emulated build) */
long fa_bf16_model_check(long count) { (void)count; return -1; }
#endif

unsigned fa_bf16_paths_built(void)
{
    unsigned paths = 1u << FA_BF16_FLOAT32;
#ifdef FA_HAVE_BF16_KERNELS
    paths |= 1u << FA_BF16_AVX512;
#endif
#ifdef FA_HAVE_AMX_KERNELS
    paths |= 1u << FA_BF16_AMX;
#endif
#ifdef FA_HAVE_ARM_BF16_KERNELS
    paths |= 1u << FA_BF16_BFDOT;
#endif
    return paths;
}

#ifdef FA_HAVE_ARM_BF16_KERNELS
/* The BFDOT kernel that goes with an AArch64 float32 kernel, where the CPU has its
 * instructions (SVE's for the SVE kernels), else NULL. */
const fa_bf16_kernel *fa_arm_bf16_kernel(const fa_kernel *kern)
{
    const unsigned f = fa_cpu_bf16_features();
    if (kern == &fa_kernel_neon && (f & 16)) return &fa_kernel_bf16_neon;
#ifdef FA_HAVE_SVE_KERNELS
    if (kern == &fa_kernel_sve256 && (f & 32)) return &fa_kernel_bf16_sve256;
    if (kern == &fa_kernel_sve128 && (f & 32)) return &fa_kernel_bf16_sve128;
#endif
    return NULL;
}
#endif

const fa_bf16_kernel *fa_bf16_kernel_for_path(int path)
{
    switch (path) {
#ifdef FA_HAVE_ARM_BF16_KERNELS
    case FA_BF16_BFDOT: return fa_arm_bf16_kernel(fa_kernel_for_isa(fa_default_isa()));
#endif
#ifdef FA_HAVE_BF16_KERNELS
    case FA_BF16_AVX512: return &fa_kernel_avx512_bf16;
#endif
#ifdef FA_HAVE_AMX_KERNELS
    case FA_BF16_AMX: return &fa_kernel_amx_bf16;
#endif
    default: return NULL;
    }
}

const char *fa_bf16_path_name(int path)
{
    return path >= 0 && path < FA_BF16_COUNT ? fa_bf16_names[path] : "unknown";
}

/* AVX512-BF16 pairs need the avx512 kernel, AVX512BW (the pair shuffles) and the
 * instruction itself; the AMX tiles all that, AVX512DQ (vreduceps, in the row-major
 * block's softmax; every CPU with AMX has it) and the tiles.  In the emulated test
 * build (compiled for AVX2 over SIMDe, the tiles a software model) only the avx2
 * kernel's instructions. */
unsigned fa_bf16_paths(void)
{
    unsigned paths = 1u << FA_BF16_FLOAT32;
#if defined(FA_X86) && defined(FA_HAVE_BF16_KERNELS)
#ifdef FA_EMULATE_BF16
    if (fa_cpu_supported_isas() & (1u << FA_ISA_AVX2)) {
        paths |= 1u << FA_BF16_AVX512;
#ifdef FA_HAVE_AMX_KERNELS
        paths |= 1u << FA_BF16_AMX;
#endif
    }
#else
    unsigned a, b, c, d;
    const int bw = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((b >> 30) & 1);
    if ((fa_cpu_supported_isas() & (1u << FA_ISA_AVX512)) && bw && (fa_cpu_bf16_features() & 1)) {
        paths |= 1u << FA_BF16_AVX512;
#ifdef FA_HAVE_AMX_KERNELS
        if ((fa_cpu_bf16_features() & 2) && ((b >> 17) & 1)) paths |= 1u << FA_BF16_AMX; /* (and AVX512DQ) */
#endif
    }
#endif
#endif
#ifdef FA_HAVE_ARM_BF16_KERNELS /* (the neon kernel's BFDOT: the SVE kernels' need SVEBF16 too) */
    if ((fa_cpu_supported_isas() & (1u << FA_ISA_NEON)) && (fa_cpu_bf16_features() & 16))
        paths |= 1u << FA_BF16_BFDOT;
#endif
    return paths;
}

static int fa_bf16_current = -1;

int fa_bf16_path(void)
{
    if (fa_bf16_current < 0) (void)fa_cpu_select(NULL, NULL, 0);
    return fa_bf16_current;
}

int fa_set_bf16_path(int path)
{
    if (path < 0 || path >= FA_BF16_COUNT || !(fa_bf16_paths() & (1u << path))) return FA_ERR_ARG;
    fa_bf16_current = path;
    return FA_OK;
}

/* Size of the L2 cache that one core uses, and where the figure came from.
 * Intel describes its caches in CPUID leaf 4; AMD leaves that leaf empty and
 * describes them in 0x8000001D (the same layout, with TOPOEXT) and, more coarsely,
 * in 0x80000006 (ECX[31:16] = L2 KiB).  Reading leaf 4 on an AMD EPYC gave nothing
 * and the old code fell back to 256 KiB on machines with 512 KiB to 2 MiB, which
 * chose smaller blocks than the cache holds.  Linux's sysfs is the next source
 * (it also covers non-x86 CPUs); 256 KiB, a small modern L2, is the last resort. */
static int64_t fa_l2_cached = 0;
static const char *fa_l2_from = "not read yet";

#ifdef FA_X86
/* Leaf 4 and 0x8000001D share one layout: subleaf i describes one cache. */
static int64_t fa_l2_from_cache_leaf(unsigned leaf)
{
    unsigned a, b, c, d;
    for (unsigned i = 0; i < 16; i++) {
        if (!__get_cpuid_count(leaf, i, &a, &b, &c, &d)) break;
        unsigned type = a & 0x1f, level = (a >> 5) & 0x7;
        if (type == 0) break;
        if (level == 2 && (type == 2 || type == 3)) {
            int64_t ways = ((b >> 22) & 0x3ff) + 1, parts = ((b >> 12) & 0x3ff) + 1;
            int64_t line = (b & 0xfff) + 1, sets = (int64_t)c + 1;
            return ways * parts * line * sets;
        }
    }
    return 0;
}

static int fa_cpu_is_amd(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    /* "AuthenticAMD" / "HygonGenuine" in EBX, EDX, ECX */
    return (b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u) ||
           (b == 0x6f677948u && d == 0x6e65476eu && c == 0x656e6975u);
}
#endif

/* /sys/devices/system/cpu/cpu0/cache/index<i>/ with level 2 and type Unified or Data. */
static int64_t fa_l2_from_sysfs(void)
{
    char path[96], buf[64];
    for (int i = 0; i < 8; i++) {
        FILE *f;
        int level = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        if (!(f = fopen(path, "r"))) break;
        if (fscanf(f, "%d", &level) != 1) level = 0;
        fclose(f);
        if (level != 2) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/type", i);
        if (!(f = fopen(path, "r"))) continue;
        int ok = fgets(buf, sizeof buf, f) && (!strncmp(buf, "Unified", 7) || !strncmp(buf, "Data", 4));
        fclose(f);
        if (!ok) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        if (!(f = fopen(path, "r"))) continue;
        long long n = 0;
        char unit = 0;
        int got = fscanf(f, "%lld%c", &n, &unit);
        fclose(f);
        if (got < 1 || n <= 0) continue;
        if (got == 2 && (unit == 'K' || unit == 'k')) n *= 1024;
        else if (got == 2 && unit == 'M') n *= 1024 * 1024;
        return (int64_t)n;
    }
    return 0;
}

/* read once (CPUID traps to the hypervisor in a guest: microseconds a call) */
static int fa_amd_cached = -1;

int fa_cpu_amd(void)
{
    if (fa_amd_cached < 0) {
#ifdef FA_X86
        fa_amd_cached = fa_cpu_is_amd();
#else
        fa_amd_cached = 0;
#endif
    }
    return fa_amd_cached;
}

int fa_cpu_pf_l2(void)
{
#ifdef FA_X86
    return !fa_cpu_amd();
#else
    return 0;
#endif
}

int64_t fa_cpu_l2_bytes(void)
{
    if (fa_l2_cached) return fa_l2_cached;
    int64_t l2 = 0;
#ifdef FA_X86
    unsigned a, b, c, d;
    if (fa_cpu_is_amd()) {
        unsigned maxext = __get_cpuid_max(0x80000000u, NULL);
        int topoext = __get_cpuid(0x80000001u, &a, &b, &c, &d) && ((c >> 22) & 1);
        if (topoext && maxext >= 0x8000001Du && (l2 = fa_l2_from_cache_leaf(0x8000001Du)))
            fa_l2_from = "CPUID leaf 0x8000001D (AMD)";
        else if (maxext >= 0x80000006u && __get_cpuid(0x80000006u, &a, &b, &c, &d) &&
                 (l2 = (int64_t)(c >> 16) * 1024))
            fa_l2_from = "CPUID leaf 0x80000006 (AMD)";
    } else if (__get_cpuid_max(0, NULL) >= 4 && (l2 = fa_l2_from_cache_leaf(4))) {
        fa_l2_from = "CPUID leaf 4";
    }
#endif
    if (!l2 && (l2 = fa_l2_from_sysfs())) fa_l2_from = "/sys/devices/system/cpu/cpu0/cache";
    if (!l2) {
        l2 = 256 * 1024;
        fa_l2_from = "not readable: assumed 256 KiB";
    }
    fa_l2_cached = l2;
    return l2;
}

const char *fa_cpu_l2_source(void)
{
    (void)fa_cpu_l2_bytes();
    return fa_l2_from;
}

static int fa_default = -1;

int fa_default_isa(void)
{
    if (fa_default < 0) fa_default = fa_cpu_select(NULL, NULL, 0);
    return fa_default;
}

int fa_set_default_isa(int isa)
{
    if (isa < 0 || isa >= FA_ISA_COUNT || !fa_kernel_for_isa(isa) ||
        !(fa_cpu_supported_isas() & (1u << isa)))
        return FA_ERR_ARG;
    fa_default = isa;
    return FA_OK;
}

/* Case-insensitive: does the comma/space separated list contain `name`? */
static int fa_list_has(const char *list, const char *name)
{
    size_t n = strlen(name);
    const char *s = list;
    while (s && *s) {
        while (*s == ',' || *s == ' ') s++;
        const char *e = s;
        while (*e && *e != ',' && *e != ' ') e++;
        if ((size_t)(e - s) == n) {
            size_t i = 0;
            while (i < n && toupper((unsigned char)s[i]) == name[i]) i++;
            if (i == n) return 1;
        }
        s = e;
    }
    return 0;
}

/* Disabling a feature disables every kernel that needs it: the avx512 kernel needs
 * AVX512F and (for its FMA and the OS/CPU baseline it assumes) AVX2, FMA and F16C;
 * the avx2 kernel AVX2, FMA and F16C; the neon kernel (AArch64) NEON, also named ASIMD;
 * the sve256 and sve128 kernels SVE (at their vector lengths) and NEON. */
int fa_cpu_select(const char *disabled, char *why, int why_len)
{
    unsigned have = fa_cpu_supported_isas();
    (void)fa_cpu_l2_bytes(); /* read once here, at import, before any thread uses it */
    (void)fa_cpu_amd();
    /* both SIMD kernels convert float16 K/V with F16C */
    int no2 = disabled && (fa_list_has(disabled, "AVX2") || fa_list_has(disabled, "FMA") ||
                           fa_list_has(disabled, "F16C"));
    int no512 = no2 || (disabled && fa_list_has(disabled, "AVX512F"));
    int isa = FA_ISA_GENERIC;
    const char *reason;
    const int noneon = disabled && (fa_list_has(disabled, "NEON") || fa_list_has(disabled, "ASIMD"));
    const int nosve = noneon || (disabled && fa_list_has(disabled, "SVE"));
    const unsigned sve = (1u << FA_ISA_SVE256) | (1u << FA_ISA_SVE128);
    if ((have & (1u << FA_ISA_SVE256)) && !nosve) {
        isa = FA_ISA_SVE256;
        reason = "the CPU has SVE at a vector length of 256 bits (and NEON)";
    } else if ((have & (1u << FA_ISA_SVE128)) && !nosve) {
        isa = FA_ISA_SVE128;
        reason = "the CPU has SVE at a vector length of 128 bits (and NEON)";
    } else if (have & (1u << FA_ISA_NEON)) {
        if (!noneon) {
            isa = FA_ISA_NEON;
            reason = (have & sve)
                         ? "SVE disabled by FASTATTN_DISABLE_CPU_FEATURES; the CPU has Advanced SIMD (NEON, AArch64)"
                         : "the CPU has Advanced SIMD (NEON, AArch64)";
        } else {
            reason = "NEON disabled by FASTATTN_DISABLE_CPU_FEATURES";
        }
    } else if ((have & (1u << FA_ISA_AVX512)) && !no512) {
        isa = FA_ISA_AVX512;
        reason = "the CPU has AVX512F, AVX2, FMA and F16C and the OS saves the zmm registers";
    } else if ((have & (1u << FA_ISA_AVX2)) && !no2) {
        isa = FA_ISA_AVX2;
        reason = (have & (1u << FA_ISA_AVX512))
                     ? "AVX512F disabled by FASTATTN_DISABLE_CPU_FEATURES; the CPU has AVX2, FMA and F16C"
                     : "the CPU (or the OS) has no usable AVX512F; it has AVX2, FMA and F16C";
    } else {
        reason = (have & (1u << FA_ISA_AVX2))
                     ? "AVX2, FMA or F16C disabled by FASTATTN_DISABLE_CPU_FEATURES"
#if defined(FA_HAVE_X86_KERNELS)
                     : "the CPU (or the OS) has neither AVX2+FMA+F16C nor AVX512F";
#elif defined(FA_HAVE_NEON_KERNELS)
                     : "the CPU does not report Advanced SIMD (NEON)";
#elif defined(__x86_64__) || defined(__i386__)
                     : "this build has no x86 SIMD kernels";
#else
                     : "this build has no SIMD kernels for this CPU";
#endif
    }
    if (why && why_len > 0) snprintf(why, (size_t)why_len, "%s", reason);
    fa_default = isa;
    /* the AMX path rounds P with AVX512-BF16 (vcvtne2ps2bf16): disabling AVX512_BF16
     * disables both */
    const int no_bf16 = disabled && (fa_list_has(disabled, "AVX512_BF16") || fa_list_has(disabled, "AVX512BF16"));
    const int no_amx = no_bf16 || (disabled && (fa_list_has(disabled, "AMX") || fa_list_has(disabled, "AMX_BF16") ||
                                                fa_list_has(disabled, "AMX_TILE")));
    const int kern_ok = FA_BF16_EMULATED ? !no2 : !no512;
    const unsigned paths = fa_bf16_paths();
    fa_bf16_current = FA_BF16_FLOAT32;
    if (kern_ok && !no_amx && (paths & (1u << FA_BF16_AMX)) && !FA_BF16_EMULATED)
        fa_bf16_current = FA_BF16_AMX; /* (the emulated build starts on the pairs: the model is slow) */
    else if (kern_ok && !no_bf16 && (paths & (1u << FA_BF16_AVX512)) &&
             (FA_BF16_EMULATED || !(fa_cpu_bf16_features() & 8)))
        fa_bf16_current = FA_BF16_AVX512; /* (not on Intel: half the FMA rate; set_bf16_path can) */
#ifdef FA_HAVE_ARM_BF16_KERNELS
    /* BFDOT where the kernel that runs has it: FASTATTN_DISABLE_CPU_FEATURES=BF16 turns it off */
    if (!(disabled && fa_list_has(disabled, "BF16")) && (paths & (1u << FA_BF16_BFDOT)) &&
        fa_arm_bf16_kernel(fa_kernel_for_isa(isa)))
        fa_bf16_current = FA_BF16_BFDOT;
#endif
    return isa;
}
