// The weight scan of `mhcrun info --check-weights`: the index of the first element of a tensor that must not
// reach a GEMM, or -1. Each byte is read once: blocks of BLOCK elements are OR-reduced (no branch in the inner
// loop, so it vectorises) on OpenMP threads, and only the first block that holds a bad element is searched
// element by element.
//   f32:  exponent all ones (NaN or Inf)               bf16 / f16: the same on 16 bits (exp_mask 0x7F80 / 0x7C00)
//   e4m3: the NaN codes 0x7F and 0xFF (e4m3fn has no Inf)
//   e8m0: a scale byte above `top` (255 is NaN; above top the scale times the format's largest value overflows)
// mhcrun/ops/scan.py holds the torch reference these are tested against.

#include <cstdint>

namespace {

constexpr int64_t BLOCK = 1 << 16;

template <typename T, typename Bad>
int64_t first_bad(const T* p, int64_t n, Bad bad, int threads) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    int64_t first = blocks;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(min : first)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t i1 = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        T acc = 0;  // of the element type: one vector lane per element
        for (int64_t i = b * BLOCK; i < i1; i++) acc |= bad(p[i]);
        if (acc && b < first) first = b;
    }
    if (first == blocks) return -1;
    for (int64_t i = first * BLOCK; i < n; i++)
        if (bad(p[i])) return i;
    return -1;
}

}  // namespace

extern "C" {

int64_t mhc_scan_f32(const uint32_t* p, int64_t n, int threads) {
    return first_bad(p, n, [](uint32_t x) { return uint32_t((x & 0x7F800000u) == 0x7F800000u); }, threads);
}

int64_t mhc_scan_f16(const uint16_t* p, int64_t n, uint16_t exp_mask, int threads) {
    return first_bad(p, n, [exp_mask](uint16_t x) { return uint16_t((x & exp_mask) == exp_mask); }, threads);
}

int64_t mhc_scan_e4m3(const uint8_t* p, int64_t n, int threads) {
    return first_bad(p, n, [](uint8_t x) { return uint8_t((x & 0x7F) == 0x7F); }, threads);
}

int64_t mhc_scan_e8m0(const uint8_t* p, int64_t n, uint8_t top, int threads) {
    return first_bad(p, n, [top](uint8_t x) { return uint8_t(x > top); }, threads);
}

}  // extern "C"
