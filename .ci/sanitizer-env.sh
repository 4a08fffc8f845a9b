# Sourced by .ci/sanitize and bench/machine_check.sh: the sanitizers' compile flags
# (FA_SAN_FLAGS, for CFLAGS and LDFLAGS) and, from `fa_sanitizer_env LOGDIR`, their
# run-time settings, every report a file in LOGDIR (why: .ci/sanitize's header).
FA_SAN_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
fa_sanitizer_env() {
    local libasan libstdcxx
    libasan=$(gcc -print-file-name=libasan.so)
    # libstdc++ loaded with ASan: its __cxa_throw interceptor needs the real one present
    # when a C++ library (jaxlib) throws, else ASan stops on a CHECK
    libstdcxx=$(gcc -print-file-name=libstdc++.so.6)
    export LD_PRELOAD="$libasan $libstdcxx"
    export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:verify_asan_link_order=0:log_path=$1/asan"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$1/ubsan"
    export FASTATTN_SANITIZE=1   # tests/test_robustness.py: RSS is not flat under ASan
}
