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

static const char *const fa_isa_names[FA_ISA_COUNT] = {"generic", "avx2", "avx512"};

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
    return isas;
}

/* L2 size per core from CPUID leaf 4 (deterministic cache parameters); 256 KiB,
 * a small modern L2, where it cannot be read. */
int64_t fa_cpu_l2_bytes(void)
{
    static int64_t cached = 0;
    if (cached) return cached;
    int64_t l2 = 256 * 1024;
#ifdef FA_X86
    unsigned a, b, c, d;
    for (unsigned i = 0; i < 16; i++) {
        if (!__get_cpuid_count(4, i, &a, &b, &c, &d)) break;
        unsigned type = a & 0x1f, level = (a >> 5) & 0x7;
        if (type == 0) break;
        if (level == 2 && (type == 2 || type == 3)) {
            int64_t ways = ((b >> 22) & 0x3ff) + 1, parts = ((b >> 12) & 0x3ff) + 1;
            int64_t line = (b & 0xfff) + 1, sets = (int64_t)c + 1;
            l2 = ways * parts * line * sets;
            break;
        }
    }
#endif
    cached = l2;
    return l2;
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
 * AVX512F and (for its FMA and the OS/CPU baseline it assumes) AVX2 and FMA. */
int fa_cpu_select(const char *disabled, char *why, int why_len)
{
    unsigned have = fa_cpu_supported_isas();
    (void)fa_cpu_l2_bytes(); /* read once here, at import, before any thread uses it */
    int no512 = disabled && (fa_list_has(disabled, "AVX512F") || fa_list_has(disabled, "AVX2") ||
                             fa_list_has(disabled, "FMA"));
    int no2 = disabled && (fa_list_has(disabled, "AVX2") || fa_list_has(disabled, "FMA"));
    int isa = FA_ISA_GENERIC;
    const char *reason;
    if ((have & (1u << FA_ISA_AVX512)) && !no512) {
        isa = FA_ISA_AVX512;
        reason = "the CPU has AVX512F, AVX2, FMA and F16C and the OS saves the zmm registers";
    } else if ((have & (1u << FA_ISA_AVX2)) && !no2) {
        isa = FA_ISA_AVX2;
        reason = (have & (1u << FA_ISA_AVX512))
                     ? "AVX512F disabled by FASTATTN_DISABLE_CPU_FEATURES; the CPU has AVX2, FMA and F16C"
                     : "the CPU (or the OS) has no usable AVX512F; it has AVX2, FMA and F16C";
    } else {
        reason = (have & (1u << FA_ISA_AVX2))
                     ? "AVX2 disabled by FASTATTN_DISABLE_CPU_FEATURES"
#ifdef FA_HAVE_X86_KERNELS
                     : "the CPU (or the OS) has neither AVX2+FMA+F16C nor AVX512F";
#else
                     : "this build has no x86 SIMD kernels";
#endif
    }
    if (why && why_len > 0) snprintf(why, (size_t)why_len, "%s", reason);
    fa_default = isa;
    return isa;
}
