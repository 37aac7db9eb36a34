// The read bandwidth a decode's weight stream can have: `threads` threads each sum their contiguous share of a
// buffer, a 64-byte line a step into four independent SSE2 sums (so the adds never wait), asking for the line
// 4 KB ahead as mhcrun's GEMV loops do. Built by benchmarks/bench_quantized.py (mhcrun.ops.native.build), called
// through ctypes. x86-64 only (SSE2 is its baseline).
#include <cstdint>
#include <emmintrin.h>

extern "C" uint64_t mhc_read_stream(const uint8_t* p, int64_t lines, int threads) {
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m128i s0 = _mm_setzero_si128(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < lines; i++) {
            const uint8_t* q = p + 64 * i;
            _mm_prefetch(reinterpret_cast<const char*>(q) + 4096, _MM_HINT_T0);
            s0 = _mm_add_epi64(s0, _mm_load_si128(reinterpret_cast<const __m128i*>(q)));
            s1 = _mm_add_epi64(s1, _mm_load_si128(reinterpret_cast<const __m128i*>(q + 16)));
            s2 = _mm_add_epi64(s2, _mm_load_si128(reinterpret_cast<const __m128i*>(q + 32)));
            s3 = _mm_add_epi64(s3, _mm_load_si128(reinterpret_cast<const __m128i*>(q + 48)));
        }
        alignas(16) uint64_t v[2];
        _mm_store_si128(reinterpret_cast<__m128i*>(v), _mm_add_epi64(_mm_add_epi64(s0, s1), _mm_add_epi64(s2, s3)));
        total += v[0] + v[1];
    }
    return total;
}
