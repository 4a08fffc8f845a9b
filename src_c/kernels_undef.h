/* kernels_undef.h -- clears the macros one instantiation of kernels_tmpl.h used,
 * so the next instantiation in the same file can define its own. */
#undef FA_T
#undef FA_V
#undef FA_VL
#undef FA_NAME
#undef FA_QK_R
#undef FA_QK_NV
#undef FA_PV_R
#undef FA_PV_NC
#undef FA_VLOAD
#undef FA_VSTORE
#undef FA_VLOADU
#undef FA_VSTOREU
#undef FA_VLOADU_N
#undef FA_VSET1
#undef FA_VZERO
#undef FA_VADD
#undef FA_VSUB
#undef FA_VMUL
#undef FA_VFMA
#undef FA_VMAX
#undef FA_VEXP
#undef FA_VNEGINF_TO_ZERO
