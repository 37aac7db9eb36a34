// Fused dequantise-and-multiply GEMV for weights kept quantised in memory (CPU: AVX-512, or AVX2).
//
// y[m, n] = sum_k x[m, g(n), k] * W[n, k], W in one of the formats of mhcrun/ops/qlinear.py:
//   fp8  (format 0): e4m3 bytes [N, K], a scale per block x block tile   [ceil(N/block), ceil(K/block)]
//   fp4  (format 1): e2m1 codes [N, K/2], low nibble first, a scale per `block` inputs of a row [N, ceil(K/block)]
//   bf16 (format 2): [N, K], no scale
// Scales are e8m0 bytes (kind 0: 2**(b - 127), 255 = NaN) or fp32 (kind 1).
// x is fp32 [M, G, K]; output row n belongs to group g(n) = n / (N / G) (G = 1 except DeepSeek's grouped wo_a).
// y is fp32 [M, N]. Each weight byte is read once per (up to) four rows of x and decoded in registers:
//   e4m3 -> AVX-512: fp16 bits ((b & 0x80) << 8 | (b & 0x7F) << 7) are the value * 2**-8, normals and subnormals
//        alike (vcvtph2ps), the 2**8 goes into the tile scale. AVX2: fp32 bits (b & 0x80) << 24 | (b & 0x7F) << 20
//        are the value * 2**-120 (a sign extension, a shift and a mask), x comes scaled by 2**112 (the same
//        products);
//   e2m1 -> AVX-512: the nibble indexes a 16-entry fp32 table (vpermps); x is split into its even and odd inputs
//        beforehand so that the low and high nibbles of 16 bytes meet 16 consecutive x values each. AVX2: the
//        nibble indexes the bf16 bytes of its value (two byte shuffles), made fp32 by shifts and masks; x is
//        permuted beforehand into the order the decoded vectors hold (fp4_permute).
// Sums are fp32: a tile's (or group's) products are summed, then multiplied by its scale (a power of two for
// e8m0: exact), then accumulated. The result equals dequantise-then-fp32-matmul up to the summation order.
// A row of W holding an e4m3 NaN code comes out NaN in every row of y, as dequantise-then-matmul gives it.
// Scales are taken as they are: the caller (mhcrun.ops.qweight) hands over only weights whose every scale is
// finite and small enough that no dequantised value overflows, checked once when the weight is loaded.
// With AVX-512 BF16 (isa 3) and x exact in bf16 (as DeepSeek's FP8 activation rounding leaves it), fp8 and fp4
// weights are decoded to bf16 instead and multiplied by vdpbf16ps (namespace avx512bf16 says when that is exact).
// With isa 3 or AVX2 and x FP8-rounded, fp4 weights are multiplied as 16-bit integers ("x as integers" says how).
// Return codes: 0 done; 3 the instruction set asked for is not this CPU's; 4 out of memory; 5 the calling thread
// flushes subnormals (the threads it runs on take its mode: take_caller_mode); 6 fp4 on AVX2 with a block that is not
// a multiple of 32 (DeepSeek's is 32); 8 a routed expert's index outside its set (mhc_qgemv_experts, mhc_moe_routed:
// nothing is read). On a non-zero code y is unspecified and the caller takes the reference path (8: the caller's error
// is reported).
//
// Also here, the mHC steps of decode rows (mhc_hc_post, mhc_hc_pre: see them below), the library being the run's
// one CPU kernel.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cpuid.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <immintrin.h>
#include <memory>
#include <new>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

extern "C" int mhc_qgemv_isa(void);
extern "C" int mhc_fp4_simulate(float* x, int64_t rows, int64_t k, int64_t block, int threads);
extern "C" int mhc_kv_fp8_encode(const float* x, uint8_t* codes, float* scales, float* rope, int64_t rows,
                                 int64_t nope, int64_t block, int64_t rd);
extern "C" int mhc_kv_fp4_encode(const float* x, uint8_t* packed, float* scales, int64_t rows, int64_t k,
                                 int64_t block);
extern "C" int mhc_act_quant_fp8(const float* x, float* y, int64_t rows, int64_t k, int64_t block, int isa,
                                 int threads);
extern "C" int mhc_qgemv_experts(int fmt, const int64_t* ptrs, int64_t experts, const int64_t* idx, int scale_kind,
                                 const float* x, float* y, int64_t b, int64_t kk, int64_t kx, int64_t n, int64_t k,
                                 int64_t block, int isa, int threads);

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define AVX2 __attribute__((target("avx2,f16c,fma")))
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx512vbmi,bmi2,f16c,fma")))
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,f16c,fma")))

namespace {

constexpr int FMT_FP8 = 0, FMT_FP4 = 1, FMT_BF16 = 2;
constexpr int MB = 4;  // rows of x sharing one decode of the weight
constexpr int64_t PARALLEL_VALUES = 1 << 16;  // values from which a loop of copies or arithmetic splits over threads

// A vector whose elements start uninitialised (buffers every element of which is written before it is read: no
// zero-fill pass, serial, over a prefill's ~100 MB of expert rows).
template <class T>
struct Uninit : std::allocator<T> {
    template <class U>
    struct rebind {
        using other = Uninit<U>;
    };
    Uninit() = default;
    template <class U>
    Uninit(const Uninit<U>&) {}
    template <class U>
    void construct(U* p) {
        ::new (static_cast<void*>(p)) U;
    }
    template <class U, class... A>
    void construct(U* p, A&&... a) {
        ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
    }
};
using Floats = std::vector<float, Uninit<float>>;

struct Job {
    int fmt, scale_kind;
    const uint8_t* w;       // weight bytes, row-major, rows of `row_bytes`
    const void* s;          // scales (row-major grid) or null
    const float* x;         // [M, G, x_stride]: K inputs (fp4: reordered for the instruction set's loop)
    float* y;               // [M, N]
    int64_t m, n, k, block, groups, row_bytes, s_cols, x_stride;
    const uint16_t* xb = nullptr;  // x in bf16 for the dot-product rows (namespace avx512bf16), or null
    const int16_t* xi = nullptr;   // x as integers for the FP4 integer rows (make_int_x), or null; then
    const float* xi_scale = nullptr;   // each row's chunk scales
    const uint8_t* xi_two = nullptr;   // and whether each row's chunk takes two windows
    const uint8_t* xi_any_two = nullptr;  // and whether any chunk of a row does (at the row's first chunk)
    int x_exp = 0;  // fp8 on AVX2: x was scaled by 2**(112 - x_exp) (avx2::scale_x), each row's sum takes 2**x_exp
    bool panel = false;  // fp4 on AVX2 with many rows of x: by panels of decoded weights (avx2::run_panels), x in order
    const uint32_t* xp = nullptr;  // isa 3, many rows of x: x in bf16 pairs (k2 a row) for gemm::run_job's panels
    bool f32_fp8 = false;  // fp8 with isa 3, x not exact in bf16: x permuted for avx512bf16::fp8_row (fp8_f32_slot)
};

struct E8m0Table {
    float v[256];
    E8m0Table() {
        for (int b = 0; b < 256; b++) v[b] = b == 255 ? NAN : std::ldexp(1.0f, b - 127);
    }
};
const E8m0Table E8M0;

inline float e8m0(uint8_t b) { return E8M0.v[b]; }

// Every e4m3 byte and e2m1 nibble as its fp32 value (exact; e4m3 0x7F / 0xFF are NaN), for mhc_decode_rows.
struct ValueTables {
    float e4m3[256], e2m1[16];
    ValueTables() {
        for (int b = 0; b < 256; b++) {
            const int e = (b >> 3) & 15, m = b & 7;
            float v = e == 15 && m == 7 ? NAN : e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
            e4m3[b] = b & 0x80 ? -v : v;
        }
        const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
        for (int c = 0; c < 16; c++) e2m1[c] = c & 8 ? -mag[c & 7] : mag[c & 7];
    }
};
const ValueTables VALUES;

inline float scale_at(const Job& j, int64_t r, int64_t c) {
    int64_t i = r * j.s_cols + c;
    return j.scale_kind == 0 ? e8m0(static_cast<const uint8_t*>(j.s)[i]) : static_cast<const float*>(j.s)[i];
}

inline uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float float_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Whether this thread flushes subnormals (MXCSR FTZ or DAZ, as torch.set_flush_denormal(True) sets them): the
// kernels then decline, since subnormal scales, weights and inputs are part of the formats.
constexpr unsigned FLUSH_BITS = 0x8040;
inline bool flushes_denormals() { return (_mm_getcsr() & FLUSH_BITS) != 0; }

// In a parallel region: this thread takes the calling thread's subnormal mode (`caller`: its MXCSR, read before the
// region) and says whether that mode flushes. A pool thread keeps the mode of the thread that made it, so without
// this a pool made while torch.set_flush_denormal(True) held would flush, and the kernels decline, for good.
inline int take_caller_mode(unsigned caller) {
    const unsigned mine = _mm_getcsr();
    if ((mine ^ caller) & FLUSH_BITS) _mm_setcsr((mine & ~FLUSH_BITS) | (caller & FLUSH_BITS));
    return (caller & FLUSH_BITS) ? 1 : 0;
}

#define INLINE inline __attribute__((always_inline))

// The first min(n, 16) of sixteen lanes.
inline __mmask16 lanes16(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1); }

// The weight bytes AHEAD bytes ahead of those being decoded, asked for now (once a 64-byte line): a core that decodes
// between its loads keeps too few misses in flight for the DRAM's latency on its own. Out of DRAM on a 2-core
// AVX-512 VM (weights cycled through 1 GB, 2 threads), 8 KB ahead: bf16 13 -> 19-21 GB/s, fp8 6.4 -> 11, fp4 6.4 ->
// 7.5-8. AVX-512's bf16 and fp8 rows, which spend fewer cycles a line than the fp4 rows, ask 2 KB ahead
// (PREFETCH_NEAR): a decode step's GEMVs (2 MB pages, 2 threads, AMX VM) 0.93x the time of 8 KB ahead, fp4 rows 2 KB
// ahead 1.06x (BENCHMARKS.md).
constexpr int64_t PREFETCH_BYTES = 8192, PREFETCH_NEAR = 2048;
// Every line of the bytes [p, p + n) asked for (prefetcht0): the few lines of a cache entry, before it is decoded.
inline void ask_lines(const void* p, int64_t n) {
    for (int64_t a = 0; a < n; a += 64) _mm_prefetch(static_cast<const char*>(p) + a, _MM_HINT_T0);
}

template <int64_t AHEAD = PREFETCH_BYTES>
INLINE void prefetch_ahead(const uint8_t* p) {
    _mm_prefetch(reinterpret_cast<const char*>(p) + AHEAD, _MM_HINT_T0);
}

// The word indexes of the high halves of 32 floats in two vectors (word 2i + 1 of each float i), for vpermt2w: the
// bf16 of 32 floats exact in it (the panels' pairs, the FP8 rows' x).
AVX512 INLINE __m512i high_halves() {
    return _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21,
                            19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
}

namespace avx512 {

AVX512 INLINE __mmask16 tail16(int64_t left) { return left >= 16 ? 0xFFFF : __mmask16((1u << left) - 1); }
AVX512 INLINE __mmask32 tail32(int64_t left) { return left >= 32 ? 0xFFFFFFFFu : __mmask32((1u << left) - 1); }

// 16 x values at p, or those of them in mk (TAIL). Hot loops run TAIL = false, without masks or branches, so
// that their accumulators stay in registers.
template <bool TAIL>
AVX512 INLINE __m512 load_x(const float* p, __mmask16 mk) {
    return TAIL ? _mm512_maskz_loadu_ps(mk, p) : _mm512_loadu_ps(p);
}

// fp8: 32 e4m3 bytes at w + k into the two 16-input partial sums of each row of x; NaN codes noted in `nan`.
template <int R, bool TAIL>
AVX512 INLINE void fp8_step(const uint8_t* w, int64_t k, __mmask32 mk, const float* const* xs, __m512 (&p0)[R],
                            __m512 (&p1)[R], __mmask32& nan) {
    const __m512i m7f = _mm512_set1_epi16(0x7F), m80 = _mm512_set1_epi16(0x80);
    __m256i raw = TAIL ? _mm256_maskz_loadu_epi8(mk, w + k) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    __m512i b = _mm512_cvtepu8_epi16(raw);
    __m512i mag = _mm512_and_si512(b, m7f);
    nan |= _mm512_cmpeq_epi16_mask(mag, m7f);
    __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(b, m80), 8), _mm512_slli_epi16(mag, 7));
    __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    for (int r = 0; r < R; r++) {
        p0[r] = _mm512_fmadd_ps(lo, load_x<TAIL>(xs[r] + k, __mmask16(mk)), p0[r]);
        p1[r] = _mm512_fmadd_ps(hi, load_x<TAIL>(xs[r] + k + 16, __mmask16(mk >> 16)), p1[r]);
    }
}

// fp8 row n: tiles of `block` inputs, 32 bytes at a time into two FMA chains per row of x, each tile's sum
// times its scale. Returns whether a NaN code was seen.
template <int R>
AVX512 bool fp8_row(const Job& j, int64_t n, const float* const* xs, float* out) {
    const uint8_t* w = j.w + n * j.row_bytes;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    __mmask32 nan = 0;
    for (int64_t k0 = 0, c = 0; k0 < j.k; k0 += j.block, c++) {
        const int64_t k1 = k0 + j.block < j.k ? k0 + j.block : j.k;
        __m512 p0[R], p1[R];
        for (int r = 0; r < R; r++) p0[r] = p1[r] = _mm512_setzero_ps();
        int64_t k = k0;
        for (; k + 32 <= k1; k += 32) {
            if (!(k & 63)) prefetch_ahead<PREFETCH_NEAR>(w + k);
            fp8_step<R, false>(w, k, 0, xs, p0, p1, nan);
        }
        if (k < k1) fp8_step<R, true>(w, k, tail32(k1 - k), xs, p0, p1, nan);
        const __m512 s = _mm512_set1_ps(scale_at(j, n / j.block, c) * 256.0f);  // fp16 values are e4m3 * 2**-8
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(p0[r], p1[r]), s, acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
    return nan != 0;
}

// fp4: the 16 e2m1 values times a group's scale, indexed by nibble (vpermps).
AVX512 INLINE __m512 fp4_table(float scale) {
    const __m512 t = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    return _mm512_mul_ps(t, _mm512_set1_ps(scale));
}

// fp4: 16 bytes (32 inputs) at byte b of a row: low nibbles meet xs[r][b..], high nibbles xs[r][half + b..].
template <int R, bool TAIL>
AVX512 INLINE void fp4_step(const uint8_t* w, int64_t b, __mmask16 mk, __m512 table, const float* const* xs,
                            int64_t half, __m512 (&acc_lo)[R], __m512 (&acc_hi)[R]) {
    __m128i raw = TAIL ? _mm_maskz_loadu_epi8(mk, w + b) : _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b));
    __m512i t = _mm512_cvtepu8_epi32(raw);
    __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(t, _mm512_set1_epi32(0x0F)), table);
    __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(t, 4), table);
    for (int r = 0; r < R; r++) {
        acc_lo[r] = _mm512_fmadd_ps(lo, load_x<TAIL>(xs[r] + b, mk), acc_lo[r]);
        acc_hi[r] = _mm512_fmadd_ps(hi, load_x<TAIL>(xs[r] + half + b, mk), acc_hi[r]);
    }
}

// fp4 row n: groups of `block` inputs (block/2 bytes), 16 bytes at a time, each through its group's scaled
// table. Groups of 32 x 2**i inputs (the released 32 among them) take two chunks per step into four FMA chains.
template <int R>
AVX512 void fp4_row(const Job& j, int64_t n, const float* const* xs, float* out) {
    const uint8_t* w = j.w + n * j.row_bytes;
    const int64_t half = j.k / 2, gb = j.block / 2;
    __m512 a0[R], a1[R], a2[R], a3[R];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_ps();
    if (gb >= 16 && (gb & (gb - 1)) == 0) {  // the group of byte b is b >> shift
        const int shift = __builtin_ctzll(gb);
        int64_t b = 0;
        for (; b + 32 <= half; b += 32) {
            if (!(b & 63)) prefetch_ahead(w + b);
            fp4_step<R, false>(w, b, 0, fp4_table(scale_at(j, n, b >> shift)), xs, half, a0, a1);
            fp4_step<R, false>(w, b + 16, 0, fp4_table(scale_at(j, n, (b + 16) >> shift)), xs, half, a2, a3);
        }
        for (; b < half; b += 16)
            fp4_step<R, true>(w, b, tail16(half - b), fp4_table(scale_at(j, n, b >> shift)), xs, half, a0, a1);
    } else {
        for (int64_t b0 = 0, c = 0; b0 < half; b0 += gb, c++) {
            const int64_t b1 = b0 + gb < half ? b0 + gb : half;
            const __m512 table = fp4_table(scale_at(j, n, c));
            for (int64_t b = b0; b < b1; b += 16) fp4_step<R, true>(w, b, tail16(b1 - b), table, xs, half, a0, a1);
        }
    }
    for (int r = 0; r < R; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_add_ps(a2[r], a3[r])));
}

// bf16: 16 weights at w + k (the bf16 bits are the top half of the fp32 ones) into acc.
template <int R, bool TAIL>
AVX512 INLINE void bf16_step(const uint16_t* w, int64_t k, __mmask16 mk, const float* const* xs, __m512 (&acc)[R]) {
    __m256i raw = TAIL ? _mm256_maskz_loadu_epi16(mk, w + k) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(v, load_x<TAIL>(xs[r] + k, mk), acc[r]);
}

// bf16, x split into its even and its odd inputs (prepare_x, k even): 32 weights (one 64-byte load) become their
// even inputs' fp32 values by a shift of each 32-bit lane and their odd ones' by a mask, no widening across lanes
// (which bound this loop at ~10 GB/s a core on Zen 4). TAIL: the `left` (even, < 32) weights left.
template <int R, bool TAIL>
AVX512 INLINE void bf16_split_step(const uint16_t* w, int64_t k, int64_t left, const float* const* xs, int64_t half,
                                   __m512 (&ae)[R], __m512 (&ao)[R]) {
    const __m512i raw = TAIL ? _mm512_maskz_loadu_epi16(__mmask32(tail32(left)), w + k) : _mm512_loadu_si512(w + k);
    const __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    const __m512 od = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xFFFF0000u))));
    const __mmask16 mk = TAIL ? tail16(left / 2) : 0xFFFF;
    for (int r = 0; r < R; r++) {
        ae[r] = _mm512_fmadd_ps(ev, load_x<TAIL>(xs[r] + k / 2, mk), ae[r]);
        ao[r] = _mm512_fmadd_ps(od, load_x<TAIL>(xs[r] + half + k / 2, mk), ao[r]);
    }
}

// Whether a job's bf16 rows take the split loop (then prepare_x splits x: AVX-512, an even number of inputs).
inline bool bf16_split(const Job& j) { return j.fmt == FMT_BF16 && j.k % 2 == 0; }

// split_x of rows of k inputs (k a multiple of 32, no padding) in AVX-512: 32 values at a time, their even and their
// odd ones by two permutes.
AVX512 void split_x(const float* x, float* xs, int64_t rows, int64_t k) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i += 32) {
            const __m512 a = _mm512_loadu_ps(x + r * k + i), b = _mm512_loadu_ps(x + r * k + i + 16);
            _mm512_storeu_ps(xs + r * k + i / 2, _mm512_permutex2var_ps(a, even, b));
            _mm512_storeu_ps(xs + r * k + k / 2 + i / 2, _mm512_permutex2var_ps(a, odd, b));
        }
}

// bf16 rows ns[0 .. Q) (one, or four of a decode's from four streams, split x only: run_quads), the sums into
// out[q][r]. A row's result does not depend on Q.
template <int R, int Q>
AVX512 void bf16_split_rows(const Job& j, const int64_t* ns, const float* const* xs, float* const* out) {
    const uint16_t* w[Q];
    __m512 a0[Q][R], a1[Q][R], a2[Q][R], a3[Q][R];
    for (int q = 0; q < Q; q++) {
        w[q] = reinterpret_cast<const uint16_t*>(j.w + ns[q] * j.row_bytes);
        for (int r = 0; r < R; r++) a0[q][r] = a1[q][r] = a2[q][r] = a3[q][r] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 64 <= j.k; k += 64)
        for (int q = 0; q < Q; q++) {
            prefetch_ahead<PREFETCH_NEAR>(reinterpret_cast<const uint8_t*>(w[q] + k));
            prefetch_ahead<PREFETCH_NEAR>(reinterpret_cast<const uint8_t*>(w[q] + k + 32));
            bf16_split_step<R, false>(w[q], k, 0, xs, j.k / 2, a0[q], a1[q]);
            bf16_split_step<R, false>(w[q], k + 32, 0, xs, j.k / 2, a2[q], a3[q]);
        }
    for (; k < j.k; k += 32)
        for (int q = 0; q < Q; q++) bf16_split_step<R, true>(w[q], k, j.k - k, xs, j.k / 2, a0[q], a1[q]);
    for (int q = 0; q < Q; q++)
        for (int r = 0; r < R; r++)
            out[q][r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[q][r], a1[q][r]),
                                                           _mm512_add_ps(a2[q][r], a3[q][r])));
}

template <int R>
AVX512 void bf16_row(const Job& j, int64_t n, const float* const* xs, float* out) {
    if (bf16_split(j)) {
        float* const outs[1] = {out};
        bf16_split_rows<R, 1>(j, &n, xs, outs);
        return;
    }
    const uint16_t* w = reinterpret_cast<const uint16_t*>(j.w + n * j.row_bytes);
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= j.k; k += 32) {
        prefetch_ahead<PREFETCH_NEAR>(reinterpret_cast<const uint8_t*>(w + k));
        bf16_step<R, false>(w, k, 0, xs, a0);
        bf16_step<R, false>(w, k + 16, 0, xs, a1);
    }
    for (; k < j.k; k += 16) bf16_step<R, true>(w, k, tail16(j.k - k), xs, a0);
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

// mhc_decode_rows, one block of a row: fp8 values [c0, c1) of row w into dst, times the block's scale sc. e4m3 ->
// fp16 bits (the value * 2**-8, exact) -> fp32, times sc * 2**8 (exact: the caller's scales are far below
// overflow): one rounding, the same product as value * sc. NaN codes (0x7F, 0xFF) become NaN.
AVX512 void fp8_decode_block(const uint8_t* w, float* dst, int64_t c0, int64_t c1, float sc) {
    const __m512i m7f = _mm512_set1_epi16(0x7F), m80 = _mm512_set1_epi16(0x80);
    const __m512 s = _mm512_set1_ps(sc * 256.0f), nan = _mm512_set1_ps(NAN);
    for (int64_t i = c0; i < c1; i += 32) {
        const __mmask32 mk = tail32(c1 - i);
        __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mk, w + i));
        __m512i mag = _mm512_and_si512(b, m7f);
        __mmask32 isnan = _mm512_cmpeq_epi16_mask(mag, m7f);
        __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(b, m80), 8), _mm512_slli_epi16(mag, 7));
        __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s);
        __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s);
        lo = _mm512_mask_mov_ps(lo, __mmask16(isnan), nan);
        hi = _mm512_mask_mov_ps(hi, __mmask16(isnan >> 16), nan);
        _mm512_mask_storeu_ps(dst + i, __mmask16(mk), lo);
        _mm512_mask_storeu_ps(dst + i + 16, __mmask16(mk >> 16), hi);
    }
}

// fp4 values [c0, c1) (c0 even) of a row of packed bytes w into dst, times sc: each nibble through the 16-entry
// e2m1 table (vpermps), low and high nibbles interleaved back into input order.
AVX512 void fp4_decode_block(const uint8_t* w, float* dst, int64_t c0, int64_t c1, float sc, const float* table) {
    const __m512 tab = _mm512_loadu_ps(table), s = _mm512_set1_ps(sc);
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const __m512i m15 = _mm512_set1_epi32(15);
    for (int64_t i = c0; i < c1; i += 32) {  // 16 bytes -> 32 values
        const int64_t left = c1 - i;
        const __mmask16 bytes = left >= 32 ? 0xFFFF : __mmask16((1u << ((left + 1) / 2)) - 1);
        __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(bytes, w + i / 2));
        __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(b, m15), tab);
        __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), tab);
        const __mmask32 out = tail32(left);
        _mm512_mask_storeu_ps(dst + i, __mmask16(out), _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), s));
        _mm512_mask_storeu_ps(dst + i + 16, __mmask16(out >> 16),
                              _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), s));
    }
}

}  // namespace avx512

// e4m3 in AVX2: eight bytes at w sign-extended to 32-bit lanes, shifted left by 20 and masked leave the fp32 bits
// (b & 0x80) << 24 | (b & 0x7F) << 20, the value times 2**-120, normals and subnormals alike (an e4m3 exponent e is
// the fp32 exponent e, whose bias is 127 instead of 7; e4m3 subnormals land on fp32 subnormals, read as they are: no
// kernel runs where the thread flushes them). NaN codes (0x7F, 0xFF) give finite bits: the callers look for them.
AVX2 INLINE __m256 e4m3_x8(const uint8_t* w) {
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_slli_epi32(q, 20), _mm256_set1_epi32(static_cast<int>(0x87F00000u))));
}

// fp8_decode_block in AVX2, eight values a step: e4m3_x8 times 2**120 (exact: the value) times sc, one rounding, the
// same product as value * sc; NaN codes blended in. Returns where it stopped (the last c1 - c0 < 8 are the caller's).
AVX2 int64_t fp8_decode_block_avx2(const uint8_t* w, float* dst, int64_t c0, int64_t c1, float sc) {
    const __m256i m7f = _mm256_set1_epi32(0x7F);
    const __m256 s = _mm256_set1_ps(sc), up = _mm256_set1_ps(0x1p120f), nan = _mm256_set1_ps(NAN);
    int64_t i = c0;
    for (; i + 8 <= c1; i += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i)));
        const __m256 isnan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, m7f), m7f));
        const __m256 v = _mm256_mul_ps(_mm256_mul_ps(e4m3_x8(w + i), up), s);
        _mm256_storeu_ps(dst + i, _mm256_blendv_ps(v, nan, isnan));
    }
    return i;
}

// fp4 values [c0, c1) (c0 even) of a row of packed bytes w into dst, times sc, eight a step (four bytes): each nibble
// shifted into its lane, its magnitude through the value table's first eight entries (vpermps reads the low three
// bits), its sign bit moved to the float's: the table's value, times sc in one rounding. Returns where it stopped.
AVX2 int64_t fp4_decode_block_avx2(const uint8_t* w, float* dst, int64_t c0, int64_t c1, float sc) {
    const __m256 mag = _mm256_loadu_ps(VALUES.e2m1), s = _mm256_set1_ps(sc);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), m15 = _mm256_set1_epi32(15);
    const __m256i m8 = _mm256_set1_epi32(8);
    int64_t i = c0;
    for (; i + 8 <= c1; i += 8) {  // value 2t + h is nibble h of byte t: nibble i - c0 of the little-endian word
        uint32_t word;
        std::memcpy(&word, w + i / 2, 4);
        const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts), m15);
        const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(code, m8), 28));
        const __m256 v = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, code), sign);
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(v, s));
    }
    return i;
}

// Values [c0, c1) of one block of a row of fp8 bytes or packed fp4 codes at src into dst, times the block's scale sc:
// one rounding each, bitwise the reference's dequantisation (NaN codes give NaN). isa >= 2: the AVX-512 block
// decoders (fp8 where sc * 2**8 is finite; fp4 from an even c0); isa 1: the AVX2 ones (fp4 from an even c0), eight
// values a step; the value tables for the rest.
void decode_block(int fmt, int isa, const uint8_t* src, float* dst, int64_t c0, int64_t c1, float sc) {
    if (fmt == FMT_FP8 && isa >= 2 && std::isfinite(sc * 256.0f)) return avx512::fp8_decode_block(src, dst, c0, c1, sc);
    if (fmt == FMT_FP4 && isa >= 2 && c0 % 2 == 0) return avx512::fp4_decode_block(src, dst, c0, c1, sc, VALUES.e2m1);
    int64_t i = c0;  // the values the vector loops leave
    if (fmt == FMT_FP8 && isa == 1) i = fp8_decode_block_avx2(src, dst, c0, c1, sc);
    if (fmt == FMT_FP4 && isa == 1 && c0 % 2 == 0) i = fp4_decode_block_avx2(src, dst, c0, c1, sc);
    if (fmt == FMT_FP8)
        for (; i < c1; i++) dst[i] = VALUES.e4m3[src[i]] * sc;
    else
        for (; i < c1; i++) dst[i] = VALUES.e2m1[(src[i >> 1] >> ((i & 1) * 4)) & 15] * sc;
}

// ---------------------------------------------------------------- x as integers, for the FP4 integer rows
// The e2m1 codes are small integers (twice each value: 0, 1, 2, 3, 4, 6, 8, 12), and an x that DeepSeek's FP8
// activation rounding made is too, in units of its chunk's smallest bit: each chunk of 128 inputs is written as
// integers X times 2**q (q: the lowest set bit of the chunk's values), in one 15-bit window when every |X| < 2**15 and
// in two (X = hi * 2**15 + lo) when every |X| < 2**30 (an FP8-rounded block spans at most 18 bits). The integer rows
// (avx512bf16's by vpdpwssd, avx2's by vpmaddwd) sum a lane's products of 16-bit integers exactly in int32 (at most
// eight products of |2w| <= 12 and |X| < 2**15 a lane: < 2**22; avx2's weights come 2**8 times that: sums below
// 2**30, multiples of 2**8, so at most 22 significant bits) and convert them exactly to fp32; the two windows join in
// one rounding, the chunk's 2**(q - 1) (avx2: 2**(q - 9), subnormal from q < -117, a power of two all the same)
// scales exactly (q >= -125), and the group's scale multiplies as on the other rows: the result is the fp32 GEMV's
// up to the summation order, as there. x with a non-finite value, or a chunk that
// spans more than 30 bits or lies outside 2**-125 .. 2**100, takes the other rows.

constexpr int INT_CHUNK = 128, INT_WINDOW = 15;

// The integer x of rows [rows, k]: per row and chunk, lo [128] then hi [128] (int16, each input i of the chunk at
// slot(i): the order the rows' decoded weights hold it, zero past k), the chunk's scale 2**(q - 1 - unit) (unit: the
// log2 of the factor the rows' weights carry) and whether it needs the hi window. False where x does not qualify (see
// above). With `top` (the panels), a chunk that needs two windows is split s = its span - 15 bits above its lowest
// set bit instead: the first window holds every value's top bits (its scale 2**(q + s - 1 - unit)), the second what
// is left below them (the bits of the chunk's few tiny values, scale 2**-s of the first's), and `two` holds s.
struct IntX {
    std::vector<int16_t> v;
    std::vector<float> scale;
    std::vector<uint8_t> two;
    std::vector<uint8_t> any_two;  // at each row's first chunk: whether any of its chunks takes two windows
    int64_t chunks = 0;
};

// Whether a chunk whose lowest set bit is 2**lo and whose largest magnitude lies below 2**hi takes the integer rows
// (inside 2**-125 .. 2**100, at most two windows), and where the panels split it (`top`), how many bits below its
// top window (0: one window). -1 where it does not take them.
inline int chunk_split(int lo, int hi, bool top) {
    if (lo < -125 || hi > 100 || hi - lo > 2 * INT_WINDOW) return -1;
    return top && hi - lo > INT_WINDOW ? hi - lo - INT_WINDOW : 0;
}

// A whole chunk of 128 values v in input order split at its top bits, as make_int_x(..., in_order, 0, ..., top) makes
// it, in AVX2 (the panels' x: a prefill's routes; the scalar loop took ~6% of a routed call): each value's lowest set
// bit from its mantissa's lowest bit (m & -m, whose exponent converting it to fp32 gives), the chunk's span by a min
// and a max, then each magnitude shifted into place per lane. The same integers, scale and split as the scalar loop;
// false where it would return false.
AVX2 bool int_chunk_top(const float* v, int16_t* dst, float& scale, uint8_t& two) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), man = _mm256_set1_epi32(0x7FFFFF);
    const __m256i one = _mm256_set1_epi32(0x800000), ff = _mm256_set1_epi32(255), zero = _mm256_setzero_si256();
    __m256i lo_v = _mm256_set1_epi32(1000), hi_v = _mm256_set1_epi32(-1000), bad = zero;
    for (int i = 0; i < INT_CHUNK; i += 8) {
        const __m256i u = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)), abs_mask);
        const __m256i e = _mm256_srli_epi32(u, 23), nz = _mm256_xor_si256(_mm256_cmpeq_epi32(u, zero),
                                                                          _mm256_set1_epi32(-1));
        bad = _mm256_or_si256(bad, _mm256_and_si256(nz, _mm256_or_si256(_mm256_cmpeq_epi32(e, zero),
                                                                        _mm256_cmpeq_epi32(e, ff))));
        const __m256i m = _mm256_or_si256(_mm256_and_si256(u, man), one);
        const __m256i bit = _mm256_and_si256(m, _mm256_sub_epi32(zero, m));  // 2**ctz(m) <= 2**23: exact in fp32
        const __m256i ctz = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(bit)), 23),
                                             _mm256_set1_epi32(127));
        const __m256i low = _mm256_add_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(150)), ctz);
        const __m256i high = _mm256_sub_epi32(e, _mm256_set1_epi32(126));
        lo_v = _mm256_min_epi32(lo_v, _mm256_blendv_epi8(_mm256_set1_epi32(1000), low, nz));
        hi_v = _mm256_max_epi32(hi_v, _mm256_blendv_epi8(_mm256_set1_epi32(-1000), high, nz));
    }
    if (!_mm256_testz_si256(bad, bad)) return false;  // subnormal (below 2**-125 anyway), inf, NaN
    alignas(32) int32_t los[8], his[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(los), lo_v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(his), hi_v);
    int lo = los[0], hi = his[0];
    for (int i = 1; i < 8; i++) lo = los[i] < lo ? los[i] : lo, hi = his[i] > hi ? his[i] : hi;
    scale = 1.0f, two = 0;
    if (hi == -1000) {  // all zero
        std::memset(dst, 0, sizeof(int16_t) * 2 * INT_CHUNK);
        return true;
    }
    const int split = chunk_split(lo, hi, true);
    if (split < 0) return false;
    two = uint8_t(split);
    scale = std::ldexp(1.0f, lo + split - 1);
    const __m128i by = _mm_cvtsi32_si128(split);
    const __m256i base = _mm256_set1_epi32(150 + lo), rest = _mm256_set1_epi32((1 << split) - 1);
    for (int i = 0; i < INT_CHUNK; i += 16) {
        __m256i tops[2], rests[2];
        for (int h = 0; h < 2; h++) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i + 8 * h));
            const __m256i u = _mm256_and_si256(w, abs_mask), sign = _mm256_srai_epi32(w, 31);
            const __m256i m = _mm256_andnot_si256(_mm256_cmpeq_epi32(u, zero),
                                                  _mm256_or_si256(_mm256_and_si256(u, man), one));
            const __m256i shift = _mm256_sub_epi32(_mm256_srli_epi32(u, 23), base);  // >= -23: shifted-out bits zero
            const __m256i mag = _mm256_srlv_epi32(_mm256_sllv_epi32(m, _mm256_max_epi32(shift, zero)),
                                                  _mm256_max_epi32(_mm256_sub_epi32(zero, shift), zero));
            const __m256i t = _mm256_srl_epi32(mag, by), r = _mm256_and_si256(mag, rest);
            tops[h] = _mm256_sub_epi32(_mm256_xor_si256(t, sign), sign);
            rests[h] = _mm256_sub_epi32(_mm256_xor_si256(r, sign), sign);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(tops[0], tops[1]), 0xD8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + INT_CHUNK + i),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(rests[0], rests[1]), 0xD8));
    }
    return true;
}

inline int in_order(int i) { return i; }

namespace avx512bf16 {
inline int fp4_slot(int i);
bool int_chunk_rows(const float* v, int16_t* dst, float& scale, uint8_t& two);
}  // namespace avx512bf16

// x rows [rows, k] (row r at x + from[r] * k where `from` is given: gathered rows read where they lie) -> out. Whole
// chunks by vectors where a loop of this CPU's makes them: AVX2's int_chunk_top (isa 1, `top`, input order) and
// AVX-512's int_chunk_rows (isa 3, not `top`, the AVX-512 rows' order); the scalar loop for the rest.
inline bool make_int_x(const float* x, int64_t rows, int64_t k, int (*order)(int), int unit, IntX& out,
                       bool top = false, const int64_t* from = nullptr, int isa = 0) {
    const int64_t chunks = (k + INT_CHUNK - 1) / INT_CHUNK;
    const bool fast = isa == 1 && top && order == in_order && unit == 0;
    const bool fast_rows = isa == 3 && !top && order == avx512bf16::fp4_slot && unit == 0;
    int slot[INT_CHUNK];
    if ((!fast && !fast_rows) || k % INT_CHUNK)  // a chunk the scalar loop makes
        for (int i = 0; i < INT_CHUNK; i++) slot[i] = order(i);
    out.chunks = chunks;
    out.v.assign(rows * chunks * 2 * INT_CHUNK, 0);
    out.scale.assign(rows * chunks, 1.0f);
    out.two.assign(rows * chunks, 0);
    out.any_two.assign(rows * chunks, 0);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < chunks; c++) {
            const float* v = x + (from ? from[r] : r) * k + c * INT_CHUNK;
            const int n = k - c * INT_CHUNK < INT_CHUNK ? int(k - c * INT_CHUNK) : INT_CHUNK;
            if (fast && n == INT_CHUNK) {
                uint8_t& two = out.two[r * chunks + c];
                if (!int_chunk_top(v, out.v.data() + (r * chunks + c) * 2 * INT_CHUNK, out.scale[r * chunks + c], two))
                    return false;
                if (two) out.any_two[r * chunks] = 1;
                continue;
            }
            if (fast_rows && n == INT_CHUNK) {
                uint8_t& two = out.two[r * chunks + c];
                if (!avx512bf16::int_chunk_rows(v, out.v.data() + (r * chunks + c) * 2 * INT_CHUNK,
                                                out.scale[r * chunks + c], two))
                    return false;
                if (two) out.any_two[r * chunks] = 1;
                continue;
            }
            int lo = 1000, hi = -1000;  // the chunk's lowest set bit, and the bit above its largest magnitude
            for (int i = 0; i < n; i++) {
                const uint32_t u = bits_of(v[i]) & 0x7FFFFFFFu, e = u >> 23;
                if (!u) continue;
                if (e == 0 || e == 255) return false;  // subnormal (below 2**-125 anyway), inf, NaN
                const uint32_t m = (u & 0x7FFFFFu) | 0x800000u;
                const int low = int(e) - 150 + __builtin_ctz(m);
                lo = low < lo ? low : lo;
                hi = int(e) - 126 > hi ? int(e) - 126 : hi;
            }
            if (hi == -1000) continue;  // all zero
            const int split = chunk_split(lo, hi, top);  // 1 .. 15 where split
            if (split < 0) return false;
            if (hi - lo > INT_WINDOW) out.two[r * chunks + c] = top ? uint8_t(split) : 1, out.any_two[r * chunks] = 1;
            // e2m1 values are half the table's integers
            out.scale[r * chunks + c] = std::ldexp(1.0f, lo + split - 1 - unit);
            int16_t* dst = out.v.data() + (r * chunks + c) * 2 * INT_CHUNK;
            for (int i = 0; i < n; i++) {
                const uint32_t u = bits_of(v[i]), a = u & 0x7FFFFFFFu;
                if (!a) continue;
                const int shift = int(a >> 23) - 150 - lo;  // >= -23: the bits shifted out are zero
                const uint64_t m = (a & 0x7FFFFFu) | 0x800000u;
                const int64_t mag = int64_t(shift >= 0 ? m << shift : m >> -shift);
                const int64_t sgn = (u >> 31) ? -1 : 1;
                if (top) {  // the top bits first
                    dst[slot[i]] = int16_t(sgn * (mag >> split));
                    dst[INT_CHUNK + slot[i]] = int16_t(sgn * (mag & ((1 << split) - 1)));
                    continue;
                }
                dst[slot[i]] = int16_t(sgn * (mag & ((1 << INT_WINDOW) - 1)));
                dst[INT_CHUNK + slot[i]] = int16_t(sgn * (mag >> INT_WINDOW));
            }
        }
    return true;
}


// ---------------------------------------------------------------- AVX-512 with BF16 dot products (vdpbf16ps)
// Where x is exact in bf16, as DeepSeek's FP8 activation rounding leaves it before every FP8 / FP4 GEMM, the weights
// are decoded to bf16 (exact: e4m3 and e2m1 values have at most four significant bits) and multiplied by
// vdpbf16ps, 32 products an instruction where an FMA takes 16. Each product of two bf16 values is exact in fp32 and
// each sum is rounded to fp32, so the result is the fp32 GEMV's up to the summation order, as on the other paths,
// provided no value is subnormal: vdpbf16ps reads subnormal inputs as zero and flushes subnormal sums. `takes_bf16`
// admits x only when every value is zero or at least 2**-110 in magnitude (and finite): then every product with an
// e4m3 value (a multiple of 2**-9) or an e2m1 one (of 2**-1) is a multiple of 2**-126, and so is every sum of them,
// rounded or not, which is zero or normal. Any other x takes the fp32 rows (namespace avx512).
// fp8 needs tiles of a multiple of 64 inputs, fp4 groups of 32 (DeepSeek's 128 and 32, at most ROW_GROUPS a row);
// others take the fp32 rows.

namespace avx512bf16 {

// Whether every x value [0, n) is exact in bf16 and zero, or finite with a biased exponent of at least `min_exp`
// (sixteen values a step, the rest one by one).
AVX512BF16 inline bool exact_in_bf16(const float* x, int64_t n, uint32_t min_exp) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), low = _mm512_set1_epi32(0xFFFF);
    const __m512i least = _mm512_set1_epi32(int(min_exp << 23)), inf = _mm512_set1_epi32(0x7F800000);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i u = _mm512_loadu_si512(x + i), a = _mm512_and_si512(u, abs_mask);
        const __mmask16 out = _mm512_mask_cmplt_epu32_mask(_mm512_test_epi32_mask(a, a), a, least) |
                              _mm512_cmpge_epu32_mask(a, inf);
        if (_mm512_test_epi32_mask(u, low) | out) return false;
    }
    for (; i < n; i++) {
        const uint32_t u = bits_of(x[i]), a = u & 0x7FFFFFFFu;
        if ((u & 0xFFFFu) || (a && (a < (min_exp << 23) || a >= 0x7F800000u))) return false;
    }
    return true;
}

// Whether the x values [0, n) qualify (see above).
inline bool takes_bf16(const float* x, int64_t n) { return exact_in_bf16(x, n, 17); }  // 17: 2**-110 biased

// The bf16 bytes (low, high) of each e4m3 magnitude code (0x7F: NaN), and the bf16 of each e2m1 code twice over (entry
// i: code i % 16), for vpermw, which indexes 32 words by the low five bits of each index word.
struct Bf16Tables {
    alignas(64) uint8_t e4m3_lo[128], e4m3_hi[128];
    alignas(64) uint16_t e4m3[128];  // the two above as words
    alignas(64) uint16_t e2m1_32[32];
    Bf16Tables() {
        for (int c = 0; c < 128; c++) {
            const uint32_t u = bits_of(VALUES.e4m3[c]) >> 16;
            e4m3_lo[c] = uint8_t(u), e4m3_hi[c] = uint8_t(u >> 8), e4m3[c] = uint16_t(u);
        }
        for (int c = 0; c < 16; c++) {
            const uint32_t u = bits_of(VALUES.e2m1[c]) >> 16;
            e2m1_32[c] = e2m1_32[c + 16] = uint16_t(u);
        }
    }
};
const Bf16Tables BF16;

// Where the decoded vectors hold input i of a chunk, as an index into the chunk's bf16 x. fp8, 64 inputs: the
// low-byte / high-byte unpacks of the 16-byte lane L hold inputs 16L + [0, 8) (v0) and 16L + [8, 16) (v1), v0 then
// v1 in x. fp4, 128 inputs (64 bytes): word L of the 64 bytes shifted right by 0, 4, 8, 12 bits (v0 .. v3) indexes
// the e2m1 table by bytes 2L's low nibble (input 4L), 2L's high one (4L + 1), 2L + 1's low one (4L + 2) and its high
// one (4L + 3); each 32-bit lane j of a vector holds inputs of group j / 4 of the chunk's four groups of 32.
inline int fp8_slot(int i) {
    const int lane = i / 16, t = i % 16;
    return 32 * (t / 8) + 8 * lane + t % 8;
}

inline int fp4_slot(int i) {
    const int b = i / 2, h = i % 2;  // byte b of the chunk, nibble h
    return 32 * (2 * (b % 2) + h) + b / 2;
}

// A whole chunk of 128 values v in input order as make_int_x(..., fp4_slot, 0, ...) makes it for these rows (not split
// at the top: each magnitude's low 15 bits in the first window, the bits above in the second), sixteen values a step:
// each value's lowest set bit from its mantissa's lowest bit (m & -m, whose exponent converting it to fp32 gives), the
// chunk's span by a masked min and max, each magnitude shifted into place per lane and its windows made int16, then
// input 4j + t of the chunk moved to slot 32t + j (fp4_slot) by word permutes. The same integers, scale and flag as the
// scalar loop (make_int_x of a decode's 2,048 values: 5.5 -> 1.1 us); false where it would return false.
struct SlotWords {  // word j: 4 (j % 16), the first of the four inputs whose slots are 32t + j (fp4_slot)
    alignas(64) int16_t at[32];
    SlotWords() {
        for (int j = 0; j < 32; j++) at[j] = int16_t(4 * (j % 16));
    }
};
const SlotWords SLOT_WORDS;

AVX512BF16 bool int_chunk_rows(const float* v, int16_t* dst, float& scale, uint8_t& two) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), man = _mm512_set1_epi32(0x7FFFFF);
    const __m512i one = _mm512_set1_epi32(0x800000), zero = _mm512_setzero_si512();
    __m512i lo_v = _mm512_set1_epi32(1000), hi_v = _mm512_set1_epi32(-1000);
    __mmask16 bad = 0;
    for (int i = 0; i < INT_CHUNK; i += 16) {
        const __m512i u = _mm512_and_si512(_mm512_loadu_si512(v + i), abs_mask), e = _mm512_srli_epi32(u, 23);
        const __mmask16 nz = _mm512_test_epi32_mask(u, u);
        bad |= _mm512_mask_cmpeq_epi32_mask(nz, e, zero) | _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255));
        const __m512i m = _mm512_or_si512(_mm512_and_si512(u, man), one);
        const __m512i bit = _mm512_and_si512(m, _mm512_sub_epi32(zero, m));  // 2**ctz(m) <= 2**23: exact in fp32
        const __m512i ctz = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(bit)), 23),
                                             _mm512_set1_epi32(127));
        const __m512i low = _mm512_add_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(150)), ctz);
        lo_v = _mm512_mask_min_epi32(lo_v, nz, lo_v, low);
        hi_v = _mm512_mask_max_epi32(hi_v, nz, hi_v, _mm512_sub_epi32(e, _mm512_set1_epi32(126)));
    }
    if (bad) return false;  // subnormal (below 2**-125 anyway), inf, NaN
    const int lo = _mm512_reduce_min_epi32(lo_v), hi = _mm512_reduce_max_epi32(hi_v);
    scale = 1.0f, two = 0;
    if (hi == -1000) {  // all zero
        std::memset(dst, 0, sizeof(int16_t) * 2 * INT_CHUNK);
        return true;
    }
    if (chunk_split(lo, hi, false) < 0) return false;
    two = hi - lo > INT_WINDOW ? 1 : 0;
    scale = std::ldexp(1.0f, lo - 1);  // e2m1 values are half the table's integers
    alignas(64) int16_t in_order[2][INT_CHUNK];  // the two windows, input order
    const __m512i base = _mm512_set1_epi32(150 + lo), low_bits = _mm512_set1_epi32((1 << INT_WINDOW) - 1);
    for (int i = 0; i < INT_CHUNK; i += 16) {
        const __m512i w = _mm512_loadu_si512(v + i), u = _mm512_and_si512(w, abs_mask);
        const __m512i sign = _mm512_srai_epi32(w, 31);
        const __m512i m = _mm512_maskz_or_epi32(_mm512_test_epi32_mask(u, u), _mm512_and_si512(u, man), one);
        const __m512i shift = _mm512_sub_epi32(_mm512_srli_epi32(u, 23), base);  // >= -23: shifted-out bits zero
        const __m512i mag = _mm512_srlv_epi32(_mm512_sllv_epi32(m, _mm512_max_epi32(shift, zero)),
                                              _mm512_max_epi32(_mm512_sub_epi32(zero, shift), zero));
        const __m512i a = _mm512_and_si512(mag, low_bits), b = _mm512_srli_epi32(mag, INT_WINDOW);
        _mm256_store_si256(reinterpret_cast<__m256i*>(in_order[0] + i),
                           _mm512_cvtepi32_epi16(_mm512_sub_epi32(_mm512_xor_si512(a, sign), sign)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(in_order[1] + i),
                           _mm512_cvtepi32_epi16(_mm512_sub_epi32(_mm512_xor_si512(b, sign), sign)));
    }
    for (int h = 0; h < 2; h++) {
        const int16_t* src = in_order[h];
        const __m512i q0 = _mm512_load_si512(src), q1 = _mm512_load_si512(src + 32);
        const __m512i q2 = _mm512_load_si512(src + 64), q3 = _mm512_load_si512(src + 96);
        for (int t = 0; t < 4; t++) {  // slot 32t + j holds input 4j + t: j < 16 from q0, q1, the rest from q2, q3
            const __m512i idx = _mm512_add_epi16(_mm512_load_si512(SLOT_WORDS.at), _mm512_set1_epi16(int16_t(t)));
            const __m512i first = _mm512_permutex2var_epi16(q0, idx, q1), second = _mm512_permutex2var_epi16(q2, idx, q3);
            _mm512_storeu_si512(dst + h * INT_CHUNK + 32 * t, _mm512_mask_mov_epi16(first, 0xFFFF0000u, second));
        }
    }
    return true;
}

// x rows [rows, k] -> [rows, kpad] (kpad: k rounded up to a chunk of `width` inputs), input i of each chunk at
// slot_of(i), zero past k: as bf16 (T = uint16_t; x already checked exact in bf16) or as fp32.
template <class T>
inline void permute_x(const float* x, T* out, int64_t rows, int64_t k, int64_t kpad, int width, int (*slot_of)(int)) {
    int slot[128];
    for (int i = 0; i < width; i++) slot[i] = slot_of(i);
    for (int64_t r = 0; r < rows; r++) {
        T* dst = out + r * kpad;
        const float* src = x + r * k;
        std::fill(dst, dst + kpad, T(0));
        for (int64_t c0 = 0; c0 < k; c0 += width) {
            const int n = k - c0 < width ? int(k - c0) : width;
            for (int i = 0; i < n; i++) {
                if constexpr (std::is_same_v<T, float>) dst[c0 + slot[i]] = src[c0 + i];
                else dst[c0 + slot[i]] = uint16_t(bits_of(src[c0 + i]) >> 16);  // exact in bf16: its top half
            }
        }
    }
}

// permute_x's bf16 x for the fp8 rows (fp8_slot, chunks of 64), whole chunks by vectors: the high halves of 32 floats
// at a time (their bf16: exact, the caller checked), then the 16-byte lanes (eight inputs each) of a chunk's two
// vectors put in fp8_slot's order (lanes 0, 2, 4, 6, then 1, 3, 5, 7); a last chunk that ends early by the scalar loop.
AVX512BF16 void permute_fp8_x(const float* x, uint16_t* out, int64_t rows, int64_t k, int64_t kpad) {
    const __m512i high = high_halves();
    const int64_t whole = k / 64 * 64;
    for (int64_t r = 0; r < rows; r++) {
        const float* src = x + r * k;
        uint16_t* dst = out + r * kpad;
        for (int64_t c0 = 0; c0 < whole; c0 += 64) {
            __m512i h[2];
            for (int q = 0; q < 2; q++)
                h[q] = _mm512_permutex2var_epi16(_mm512_loadu_si512(src + c0 + 32 * q), high,
                                                 _mm512_loadu_si512(src + c0 + 32 * q + 16));
            _mm512_storeu_si512(dst + c0, _mm512_shuffle_i64x2(h[0], h[1], _MM_SHUFFLE(2, 0, 2, 0)));
            _mm512_storeu_si512(dst + c0 + 32, _mm512_shuffle_i64x2(h[0], h[1], _MM_SHUFFLE(3, 1, 3, 1)));
        }
        if (whole < k) permute_x(src + whole, dst + whole, 1, k - whole, kpad - whole, 64, fp8_slot);
    }
}

AVX512BF16 INLINE __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

AVX512BF16 INLINE __m512bh load_xb(const uint16_t* p) { return as_bh(_mm512_loadu_si512(p)); }

// fp8: 64 e4m3 bytes at w + k (TAIL: those in mk, the rest zero) -> their bf16 values, the low-byte unpack of each
// 16-byte lane (v[0]) and the high-byte one (v[1]). A NaN code (0x7F, 0xFF) decodes to a bf16 NaN, whose products and
// sums make the row's result NaN: no check of its own.
template <bool TAIL>
AVX512BF16 INLINE void fp8_words(const uint8_t* w, int64_t k, __mmask64 mk, const __m512i (&t)[4], __m512i (&v)[2]) {
    const __m512i m7f = _mm512_set1_epi8(0x7F), m80 = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i b = TAIL ? _mm512_maskz_loadu_epi8(mk, w + k) : _mm512_loadu_si512(w + k);
    const __m512i mag = _mm512_and_si512(b, m7f);
    const __m512i lo = _mm512_permutex2var_epi8(t[0], mag, t[1]);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t[2], mag, t[3]), b, m80, 0xF8);  // | sign
    v[0] = _mm512_unpacklo_epi8(lo, hi), v[1] = _mm512_unpackhi_epi8(lo, hi);
}

// fp8: a step's 64 weights (fp8_words) into the partial sums of each row of x in bf16, by vdpbf16ps.
template <int R, bool TAIL>
AVX512BF16 INLINE void fp8_step(const uint8_t* w, int64_t k, __mmask64 mk, const __m512i (&t)[4],
                                const uint16_t* const* xs, __m512 (&p0)[R], __m512 (&p1)[R]) {
    __m512i v[2];
    fp8_words<TAIL>(w, k, mk, t, v);
    for (int r = 0; r < R; r++) {
        p0[r] = _mm512_dpbf16_ps(p0[r], as_bh(v[0]), load_xb(xs[r] + k));
        p1[r] = _mm512_dpbf16_ps(p1[r], as_bh(v[1]), load_xb(xs[r] + k + 32));
    }
}

// fp8 against an x that is not exact in bf16 (no activation rounding: DeepSeek's grouped wo_a, or a run with the
// quantisation simulation off), by fp32 FMAs: the 64 bytes of a step through the bf16 tables (fp8_words), each bf16
// made its fp32 by a shift (even words) or a mask (odd words), no widening across lanes; x permuted beforehand into the
// order the four vectors hold (fp8_f32_slot, permute_x). Exact values, so the same products and sums as namespace avx512's fp8
// rows up to their order; those decode through fp16 and vcvtph2ps, twice the shuffles and conversions: an FP8 weight of
// 2,048 x 2,048 out of DRAM, 2 threads, AMX VM, 426 -> 333 us (a 1 MB one in L2, one thread: 10.8 -> 14.5-15.8 GB/s).
// A NaN code decodes to NaN, which makes the row NaN through its products.
inline int fp8_f32_slot(int i) {  // input i of a 64-input chunk -> its place in the chunk's permuted x
    const int lane = i / 16, t = i % 16, vec = 2 * (t / 8) + t % 2;  // vectors: even, odd words of v0, then of v1
    return 16 * vec + 4 * lane + (t % 8) / 2;
}

// fp8: a step's 64 weights (fp8_words) into the partial sums of each row of x in fp32 (fp8_f32_slot's order), by FMAs.
template <int R, bool TAIL>
AVX512BF16 INLINE void fp8_step(const uint8_t* w, int64_t k, __mmask64 mk, const __m512i (&t)[4],
                                const float* const* xs, __m512 (&p0)[R], __m512 (&p1)[R]) {
    __m512i v[2];
    fp8_words<TAIL>(w, k, mk, t, v);
    const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512 f[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(v[0], 16)),
                         _mm512_castsi512_ps(_mm512_and_si512(v[0], top)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(v[1], 16)),
                         _mm512_castsi512_ps(_mm512_and_si512(v[1], top))};
    for (int r = 0; r < R; r++) {
        const float* x = xs[r] + k;
        p0[r] = _mm512_fmadd_ps(f[0], _mm512_loadu_ps(x), p0[r]);
        p1[r] = _mm512_fmadd_ps(f[1], _mm512_loadu_ps(x + 16), p1[r]);
        p0[r] = _mm512_fmadd_ps(f[2], _mm512_loadu_ps(x + 32), p0[r]);
        p1[r] = _mm512_fmadd_ps(f[3], _mm512_loadu_ps(x + 48), p1[r]);
    }
}

// fp8 rows ns[0 .. Q) (one, or four of a decode's from four streams: run_quads): tiles of `block` inputs, 64 bytes a
// step into two chains per row of x (x in bf16: vdpbf16ps; fp32: FMAs), each tile's sum times its scale, the sums
// into out[q][r]. A row's result does not depend on Q. A NaN code makes its row NaN through its products.
template <int R, int Q, class X>
AVX512BF16 void fp8_rows(const Job& j, const int64_t* ns, const X* const* xs, float* const* out) {
    const __m512i t[4] = {_mm512_load_si512(BF16.e4m3_lo), _mm512_load_si512(BF16.e4m3_lo + 64),
                          _mm512_load_si512(BF16.e4m3_hi), _mm512_load_si512(BF16.e4m3_hi + 64)};
    const uint8_t* w[Q];
    int64_t srow[Q];  // each row's row of tile scales (no division a tile)
    __m512 acc[Q][R];
    for (int q = 0; q < Q; q++) {
        w[q] = j.w + ns[q] * j.row_bytes, srow[q] = ns[q] / j.block;
        for (int r = 0; r < R; r++) acc[q][r] = _mm512_setzero_ps();
    }
    const bool pairs = j.block == 128 && j.k % 128 == 0;  // DeepSeek's tiles, whole: two steps each, unrolled
    for (int64_t k0 = 0, c = 0; k0 < j.k; k0 += j.block, c++) {
        const int64_t k1 = k0 + j.block < j.k ? k0 + j.block : j.k;
        __m512 p0[Q][R], p1[Q][R];
        for (int q = 0; q < Q; q++)
            for (int r = 0; r < R; r++) p0[q][r] = p1[q][r] = _mm512_setzero_ps();
        auto step = [&](int64_t k) AVX512BF16 {  // a whole step of each row
            for (int q = 0; q < Q; q++) {
                prefetch_ahead<PREFETCH_NEAR>(w[q] + k);
                fp8_step<R, false>(w[q], k, 0, t, xs, p0[q], p1[q]);
            }
        };
        int64_t k = k0;
        if (pairs) {
            step(k0), step(k0 + 64);
        } else {
            for (; k + 64 <= k1; k += 64) step(k);
            if (k < k1)
                for (int q = 0; q < Q; q++)
                    fp8_step<R, true>(w[q], k, _bzhi_u64(~0ull, unsigned(k1 - k)), t, xs, p0[q], p1[q]);
        }
        for (int q = 0; q < Q; q++) {
            const __m512 s = _mm512_set1_ps(scale_at(j, srow[q], c));
            for (int r = 0; r < R; r++)
                acc[q][r] = _mm512_fmadd_ps(_mm512_add_ps(p0[q][r], p1[q][r]), s, acc[q][r]);
        }
    }
    for (int q = 0; q < Q; q++)
        for (int r = 0; r < R; r++) out[q][r] = _mm512_reduce_add_ps(acc[q][r]);
}

constexpr int64_t ROW_GROUPS = 2048;  // fp4: groups a row may have here (K up to 65,536); longer: the fp32 rows

// fp4: the scales of row n as fp32, sc [s_cols rounded up to 16] (e8m0 byte b: 2**(b - 127), b = 0 -> 2**-127; fp32 as
// they are; groups past the row's end 1: their bytes and x are zero), converted once a row: a step then takes its four
// by one load and one permute.
AVX512BF16 INLINE void row_scales(const Job& j, int64_t n, float* sc) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t c = 0; c < j.s_cols; c += 16) {
        const __mmask16 live = lanes16(j.s_cols - c);
        __m512 v;
        if (j.scale_kind == 1) {
            v = _mm512_mask_loadu_ps(one, live, static_cast<const float*>(j.s) + n * j.s_cols + c);
        } else {
            const uint8_t* bytes = static_cast<const uint8_t*>(j.s) + n * j.s_cols + c;
            const __m512i u = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, bytes)), 23);
            v = _mm512_mask_mov_ps(_mm512_castsi512_ps(u), _mm512_cmpeq_epi32_mask(u, _mm512_setzero_si512()),
                                   _mm512_set1_ps(0x1p-127f));
            v = _mm512_mask_mov_ps(one, live, v);
        }
        _mm512_store_ps(sc + c, v);
    }
}

// fp4: the scales of groups c .. c + 3 (row_scales), each over the four fp32 lanes of its 16-byte lane.
AVX512BF16 INLINE __m512 fp4_scales(const float* sc, int64_t c) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(sc + c)));
}

// fp4: the 128 nibbles of 64 bytes at w + b (TAIL: those in mk, the rest zero) through the 32-word table t (entry i:
// code i % 16) -> four vectors of words in fp4_slot's order: four vpermw (fewer shuffles than byte tables and
// unpacks: FP4 rows 17.7 -> 19.4 GB/s in L3 on 2 Zen 4 cores).
template <bool TAIL>
AVX512BF16 INLINE void fp4_words(const uint8_t* w, int64_t b, __mmask64 mk, __m512i t, __m512i (&v)[4]) {
    const __m512i raw = TAIL ? _mm512_maskz_loadu_epi8(mk, w + b) : _mm512_loadu_si512(w + b);
    v[0] = _mm512_permutexvar_epi16(raw, t);
    v[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), t);
    v[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 8), t);
    v[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 12), t);
}

constexpr int64_t QUAD_GROUPS = 256;  // fp4 rows four at a time: groups a row may have (K up to 8,192)

// fp4 rows ns[0 .. Q) (one, or four of a decode's from four streams, each at most QUAD_GROUPS groups: run_quads): each
// 64-byte step (128 inputs, groups c .. c + 3) into acc of each row of x by `step` (a struct whose run<R, TAIL>(w, b,
// mk, s, acc) takes the step's bytes and its four groups' scales s), then the sums into out[q][r]. A row's result does
// not depend on Q. One row asks for its bytes PREFETCH_BYTES ahead; four, each PREFETCH_NEAR ahead in its stream.
template <int R, int Q, class Step>
AVX512BF16 INLINE void fp4_steps(const Job& j, const int64_t* ns, const Step& step, float* const* out) {
    constexpr int64_t AHEAD = Q == 1 ? PREFETCH_BYTES : PREFETCH_NEAR;
    const int64_t bytes = j.k / 2;
    alignas(64) float sc[Q][Q == 1 ? ROW_GROUPS : QUAD_GROUPS];
    const uint8_t* w[Q];
    __m512 acc[Q][R];
    for (int q = 0; q < Q; q++) {
        w[q] = j.w + ns[q] * j.row_bytes;
        row_scales(j, ns[q], sc[q]);
        for (int r = 0; r < R; r++) acc[q][r] = _mm512_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 64 <= bytes; b += 64)
        for (int q = 0; q < Q; q++) {
            prefetch_ahead<AHEAD>(w[q] + b);
            step.template run<R, false>(w[q], b, 0, fp4_scales(sc[q], b / 16), acc[q]);
        }
    if (b < bytes)
        for (int q = 0; q < Q; q++)
            step.template run<R, true>(w[q], b, _bzhi_u64(~0ull, unsigned(bytes - b)), fp4_scales(sc[q], b / 16),
                                       acc[q]);
    for (int q = 0; q < Q; q++)
        for (int r = 0; r < R; r++) out[q][r] = _mm512_reduce_add_ps(acc[q][r]);
}

// fp4 by vdpbf16ps: the e2m1 table in bf16 against x in bf16.
struct Bf16Fp4Step {
    __m512i t;
    const uint16_t* const* xs;
    template <int R, bool TAIL>
    AVX512BF16 INLINE void run(const uint8_t* w, int64_t b, __mmask64 mk, __m512 s, __m512 (&acc)[R]) const {
        __m512i v[4];
        fp4_words<TAIL>(w, b, mk, t, v);
        for (int r = 0; r < R; r++) {
            const uint16_t* x = xs[r] + 2 * b;
            __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(v[0]), load_xb(x));
            __m512 q = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(v[2]), load_xb(x + 64));
            p = _mm512_dpbf16_ps(p, as_bh(v[1]), load_xb(x + 32));
            q = _mm512_dpbf16_ps(q, as_bh(v[3]), load_xb(x + 96));
            acc[r] = _mm512_fmadd_ps(_mm512_add_ps(p, q), s, acc[r]);
        }
    }
};

template <int R>
AVX512BF16 void fp4_row(const Job& j, int64_t n, const uint16_t* const* xs, float* out) {
    float* const outs[1] = {out};
    fp4_steps<R, 1>(j, &n, Bf16Fp4Step{_mm512_load_si512(BF16.e2m1_32), xs}, outs);
}

// ---------------------------------------------------------------- FP4 rows by 16-bit integer dot products (vpdpwssd)
// On the AMX VM's Intel cores vdpbf16ps retires one every 2 cycles and the FP4 rows above are bound by it; vpdpwssd
// (pairs of int16 products summed into int32) retires two a cycle, as FMAs do. x as integers: make_int_x.

// The e2m1 codes as twice their values, int16, each twice over (entry i: code i % 16), for vpermw.
struct IntTable {
    alignas(64) int16_t e2m1x2[32];
    IntTable() {
        const int16_t mag[8] = {0, 1, 2, 3, 4, 6, 8, 12};
        for (int c = 0; c < 32; c++) e2m1x2[c] = int16_t(c & 8 ? -mag[c & 7] : mag[c & 7]);
    }
};
const IntTable INT_TABLE;

// Four int16 vectors of x against the decoded weights, summed per lane in int32 (exact) -> fp32 (exact).
AVX512BF16 INLINE __m512 int_dot(const __m512i (&v)[4], const int16_t* x) {
    const __m512i p = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), v[0], _mm512_loadu_si512(x)),
                                          v[1], _mm512_loadu_si512(x + 32));
    const __m512i q = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), v[2], _mm512_loadu_si512(x + 64)),
                                          v[3], _mm512_loadu_si512(x + 96));
    return _mm512_cvtepi32_ps(_mm512_add_epi32(p, q));
}

// fp4 by vpdpwssd: the e2m1 table as integers against x's integer windows (chunk c = b / 64, in one window or two).
struct IntFp4Step {
    __m512i t;
    const int16_t* const* xs;
    const float* xsc[MB];    // each row's chunk scales
    const uint8_t* two[MB];  // and whether its chunk takes two windows
    template <int R, bool TAIL>
    AVX512BF16 INLINE void run(const uint8_t* w, int64_t b, __mmask64 mk, __m512 s, __m512 (&acc)[R]) const {
        __m512i v[4];
        fp4_words<TAIL>(w, b, mk, t, v);
        const int64_t c = b / 64;
        for (int r = 0; r < R; r++) {
            const int16_t* x = xs[r] + c * 2 * INT_CHUNK;
            __m512 f = int_dot(v, x);
            if (two[r][c]) f = _mm512_fmadd_ps(int_dot(v, x + INT_CHUNK), _mm512_set1_ps(0x1p15f), f);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(f, _mm512_set1_ps(xsc[r][c])), s, acc[r]);
        }
    }
};

template <int R, int Q = 1>
AVX512BF16 void fp4_int_rows(const Job& j, const int64_t* ns, const int16_t* const* xs, float* const* out) {
    IntFp4Step step{_mm512_load_si512(INT_TABLE.e2m1x2), xs, {}, {}};
    for (int r = 0; r < R; r++) {
        const int64_t at = (xs[r] - j.xi) / (2 * INT_CHUNK);  // the row's first chunk
        step.xsc[r] = j.xi_scale + at, step.two[r] = j.xi_two + at;
    }
    fp4_steps<R, Q>(j, ns, step, out);
}

}  // namespace avx512bf16

// ---------------------------------------------------------------- prefill GEMM by BF16 dot products
// y [M, N] = x [M, K] . W^T for a chunk of many rows: W decoded (value times scale) into bf16 panels of NB output
// columns, each panel once, then multiplied into every row of x by vdpbf16ps (MR rows by 2 x 16 columns a
// micro-tile, all of K), sums in fp32. Exact up to the summation order, as the GEMV rows are, when x qualifies
// (`pack_row`) and `scales_take`:
// x exact in bf16 with every value zero or at least 2**-40 in magnitude (each a multiple of 2**-47), and every scale
// a power of two of at least 2**-70 (each weight value then a multiple of 2**-79 and exact in bf16): every product
// and sum is a multiple of 2**-126, zero or normal, so the flushing of subnormals changes nothing. The activation
// rounding's x always qualifies (its values are at least 2**-31).

namespace gemm {

constexpr int NB = 32, MR = 8;
// rows of x from which a job of the GEMV calls (a routed expert's in a prefill chunk) takes the panels (run_job) where
// its x and scales qualify: where they beat the GEMV rows on a Zen 4 VM. FP4: a routed call of 64 experts ([1,024 x
// 2,048] twice and [2,048 x 1,024], 2 threads) with the panels from 4, 5, 6 and 8 rows, ms at 48 / 64 / 96 / 128
// tokens (4.5 to 12 rows an expert): 21.8-24.7 / 25.6-31.2 / 32.7-34.5 / 39.3-42.1 from 4 (from 2 and 3 no faster),
// 24.9 / 28.8 / 35.5 / 42.1 from 5, 28.4 / 34.6 / 37.4 / 42.3 from 6, 30.8 / 38.9 / 38.8 / 43.9 from 8. FP8 (an
// [1,024 x 2,048] weight, G multiply-adds/s, panels against GEMV rows): 73 / 102 at 8 rows, 94 / 85 at 12, 64-115 / 58
// at 16; routed calls from 8 and 12 rows no faster than from 16.
constexpr int64_t JOB_ROWS_FP4 = 4, JOB_ROWS_FP8 = 16;

// Row xr [k] of x written as bf16 pairs, sixteen pairs (a chunk) at a time, chunk c at out + c * chunk_stride, `k2s`
// pairs in all (zero past k; a last chunk that ends early is stored masked); false where a value does not qualify
// (see above: exact in bf16, zero or finite and at least 2**-40 in magnitude).
AVX512 bool pack_row(const float* xr, int64_t k, int64_t k2s, uint32_t* out, int64_t chunk_stride) {
    const __m512i pick = high_halves(), low = _mm512_set1_epi32(0xFFFF), mag = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i least = _mm512_set1_epi32(87 << 23), inf = _mm512_set1_epi32(0x7F800000);  // 87: 2**-40 biased
    __mmask16 bad = 0;
    for (int64_t c = 0; 16 * c < k2s; c++) {
        const int64_t i = 32 * c;
        const __m512i u0 = _mm512_maskz_loadu_epi32(avx512::tail16(std::max<int64_t>(0, k - i)), xr + i);
        const __m512i u1 = _mm512_maskz_loadu_epi32(avx512::tail16(std::max<int64_t>(0, k - i - 16)), xr + i + 16);
        for (const __m512i u : {u0, u1}) {
            const __m512i a = _mm512_and_si512(u, mag);
            bad |= _mm512_test_epi32_mask(u, low) |
                   (_mm512_test_epi32_mask(a, a) &
                    (_mm512_cmplt_epu32_mask(a, least) | _mm512_cmpge_epu32_mask(a, inf)));
        }
        const __m512i pairs = _mm512_permutex2var_epi16(u0, pick, u1);
        _mm512_mask_storeu_epi32(out + c * chunk_stride, avx512::tail16(k2s - 16 * c), pairs);
    }
    return !bad;
}

// Whether every scale of the job's grid (an FP8 weight's tiles, an FP4 weight's rows of groups) qualifies (see above).
// Without an early exit, so that the compiler vectorizes it: a prefill's routed call asks it of every expert it runs
// by the panels.
inline bool scales_take(const Job& j) {
    const int64_t count = (j.fmt == FMT_FP8 ? (j.n + j.block - 1) / j.block : j.n) * j.s_cols;
    uint32_t bad = 0;
    if (j.scale_kind == 0) {  // e8m0: the byte is the biased exponent (57: 2**-70; 255: NaN)
        const uint8_t* s = static_cast<const uint8_t*>(j.s);
        for (int64_t i = 0; i < count; i++) bad |= uint32_t(s[i] < 57) | uint32_t(s[i] == 255);
    } else {
        const uint32_t* s = static_cast<const uint32_t*>(j.s);
        for (int64_t i = 0; i < count; i++)
            bad |= uint32_t((s[i] & 0x807FFFFFu) != 0) | uint32_t((s[i] >> 23) < 57) | uint32_t((s[i] >> 23) == 255);
    }
    return !bad;
}

// This thread's scratch buffer of type T (one per T) of at least n values, kept from call to call: a prefill chunk
// makes hundreds of GEMMs, each of which would otherwise map, fault in and zero a fresh megabyte a thread. Its
// contents are whatever the last call left: its users write every value they read. nullptr where it cannot grow.
template <typename T>
T* scratch(size_t n) {
    thread_local std::vector<T> buf;
    if (buf.size() < n) {
        try {
            buf.resize(n);
        } catch (const std::bad_alloc&) {
            return nullptr;
        }
    }
    return buf.data();
}

// A panel's rows are decoded 16 at a time into a buffer of ROW_WORDS(k2p) floats a row (`rows`: 16 of them).
inline int64_t row_words(int64_t k2p) { return 2 * k2p + 32; }

// 16 x 16 dwords, r[c] holding row c's dwords 0..15, transposed in registers: r[p] then holds dword p of every row.
AVX512 INLINE void transpose16(__m512i (&r)[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) {  // u[g + j], 128-bit lane L: rows g .. g + 3 at dword 4L + j
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int j = 0; j < 4; j++) {  // the 4 x 4 lanes of u[j], u[4 + j], u[8 + j], u[12 + j]
        const __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), x1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        const __m512i x2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i x3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        r[j] = _mm512_shuffle_i32x4(x0, x2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(x1, x3, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
        r[12 + j] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
    }
}

// The exponent of a scale that scales_take admits (a power of two) times 128, in both words of a dword: added to the
// words of a pair of nonzero bf16 values, it multiplies both by the scale (exact: the products are normal and finite,
// as scales_take and the load-time overflow check ensure).
inline uint32_t exponent_words(float scale) {
    const uint32_t w = uint16_t((int(bits_of(scale) >> 23) - 127) * 128);
    return w | w << 16;
}

// For panel_of_codes, each dword c of a vector from dword c: the bit offsets (vpmultishiftqb, within its qword) of
// code byte t's bits 0 .. 7 and 4 .. 11 in the low and high words (Fp4Codes); the byte indexes (vpermb) of code bytes
// 2t and 2t + 1 into the words (Fp8Codes), and of byte t into both words (an FP4 panel's e8m0 scales:
// column_exponents).
struct PanelSelect {
    alignas(64) uint8_t fp4[4][64], fp8[2][64], twice[4][64];
    PanelSelect() {
        for (int i = 0; i < 64; i++) {
            const int dword = (i & 4) * 8;  // the dword's first bit in its qword
            for (int t = 0; t < 4; t++) {
                fp4[t][i] = uint8_t(i % 2 ? 0 : dword + 8 * t + (i & 2) * 2);
                twice[t][i] = uint8_t((i & ~3) + t);
            }
            for (int t = 0; t < 2; t++) fp8[t][i] = uint8_t((i & ~3) + 2 * t + (i & 2) / 2);
        }
    }
};
const PanelSelect SELECT;

// Sixteen rows' next 64 bytes from `at(c)` (row c's, those in mk; zero past `live` rows), transposed as dwords in
// registers: v[q] then holds bytes 4q .. 4q + 3 of every row.
template <class At>
AVX512 INLINE void load_transposed(__m512i (&v)[16], int live, __mmask64 mk, const At& at) {
    for (int c = 0; c < 16; c++) v[c] = c < live ? _mm512_maskz_loadu_epi8(mk, at(c)) : _mm512_setzero_si512();
    transpose16(v);
}

// The first min(n, 64) of 64 bytes.
inline __mmask64 bytes64(int64_t n) { return n >= 64 ? ~0ull : n <= 0 ? 0 : (1ull << n) - 1; }

// The scales of `live` rows from r0 for each of `groups` scale columns, as exponent_words: out[g * 16 + c] for row
// r0 + c (FP8: its tile row; past `live` rows any value, their codes being zero). FP4 in e8m0 by vectors (the bytes of
// sixteen rows transposed in registers, each exponent (b - 127) * 128 in both words of its dword); the rest one by
// one.
AVX512BF16 void column_exponents(const Job& j, int64_t r0, int live, int64_t groups, uint32_t* out) {
    if (j.fmt == FMT_FP4 && j.scale_kind == 0) {
        const uint8_t* s = static_cast<const uint8_t*>(j.s) + r0 * j.s_cols;
        for (int64_t g0 = 0; g0 < groups; g0 += 64) {
            __m512i v[16];
            load_transposed(v, live, bytes64(groups - g0), [&](int c) { return s + c * j.s_cols + g0; });
            for (int64_t g = g0; g < std::min(groups, g0 + 64); g++) {
                const __m512i sel = _mm512_load_si512(SELECT.twice[(g - g0) % 4]);
                const __m512i b = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, sel, v[(g - g0) / 4]);
                const __m512i e = _mm512_sub_epi16(_mm512_slli_epi16(b, 7), _mm512_set1_epi16(127 * 128));
                _mm512_storeu_si512(out + g * 16, e);
            }
        }
        return;
    }
    for (int64_t g = 0; g < groups; g++)
        for (int c = 0; c < 16; c++) {
            const int64_t r = j.fmt == FMT_FP8 ? (r0 + c) / j.block : r0 + c;
            out[g * 16 + c] = c < live ? exponent_words(scale_at(j, r, g)) : 0;
        }
}

// FP4 pair t of each dword of v (the code byte 4q + t of a row: its values 2p, low nibble, and 2p + 1, high): one
// multishift puts that byte's bits 0 .. 7 in the dword's low word and its bits 4 .. 11 in the high word, whose low
// five bits (the low nibble; the high one) index the 32-word e2m1 table (vpermw; entry i: code i % 16, the bits above
// ignored). Its nonzero values are the ones to scale.
struct Fp4Codes {
    static constexpr int BYTES = 1;  // code bytes a pair
    __m512i table;
    AVX512BF16 Fp4Codes() : table(_mm512_load_si512(avx512bf16::BF16.e2m1_32)) {}
    AVX512BF16 INLINE __m512i pair(__m512i v, int t, __mmask32& scaled) const {
        const __m512i index = _mm512_multishift_epi64_epi8(_mm512_load_si512(SELECT.fp4[t]), v);
        const __m512i pair = _mm512_permutexvar_epi16(index, table);
        scaled = _mm512_test_epi16_mask(pair, _mm512_set1_epi16(0x7FFF));
        return pair;
    }
};

// FP8 pair t of each dword of v (code bytes 2t and 2t + 1 of a row, widened into words by a byte permute): the
// magnitude code indexes the 128-word e4m3 table (two vpermt2w and a blend), the sign bit moved to the word's. Its
// nonzero values but NaN's (0x7F codes) are the ones to scale.
struct Fp8Codes {
    static constexpr int BYTES = 2;
    __m512i t0, t1, t2, t3;  // the table's four vectors of 32 words
    AVX512BF16 Fp8Codes() {
        const uint16_t* t = avx512bf16::BF16.e4m3;
        t0 = _mm512_load_si512(t), t1 = _mm512_load_si512(t + 32), t2 = _mm512_load_si512(t + 64);
        t3 = _mm512_load_si512(t + 96);
    }
    AVX512BF16 INLINE __m512i pair(__m512i v, int t, __mmask32& scaled) const {
        const __m512i b = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, _mm512_load_si512(SELECT.fp8[t]), v);
        const __m512i m7f = _mm512_set1_epi16(0x7F), code = _mm512_and_si512(b, m7f);
        const __m512i val = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(code, _mm512_set1_epi16(0x40)),
                                                    _mm512_permutex2var_epi16(t0, code, t1),
                                                    _mm512_permutex2var_epi16(t2, code, t3));
        const __m512i pair = _mm512_or_si512(val, _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
        scaled = _mm512_test_epi16_mask(pair, _mm512_set1_epi16(0x7FFF)) & _mm512_cmpneq_epi16_mask(code, m7f);
        return pair;
    }
};

// The panel straight from the codes (FP4 groups, FP8 tiles a multiple of 32 values): for each sixteen columns, the
// next 64 code bytes of each of their rows (zero past the row's k2 pairs and past `cols`) transposed as dwords in
// registers (load_transposed); each pair's bytes of the sixteen rows then widened into dwords by one byte permute
// (SELECT), decoded (Codes::pair) and scaled by the exponents of the sixteen rows' scales of its group (FP8: of its
// rows' tiles; column_exponents). Bitwise decode_panel's generic values: a byte transpose of the codes instead of a
// dword transpose of decoded pairs, a quarter (FP4) or half (FP8) of the shuffles a pair.
template <class Codes>
AVX512BF16 void panel_of_codes(const Job& j, int64_t n0, int cols, uint32_t* panel, int64_t k2, int64_t k2p) {
    constexpr int B = Codes::BYTES, PER_DWORD = 4 / B, STEP = 64 / B;  // pairs a dword of codes, a load
    const Codes codes;
    const int64_t group = j.block / 2, groups = (k2 + group - 1) / group;  // pairs a scale (a multiple of 16)
    thread_local std::vector<uint32_t, Uninit<uint32_t>> exps;  // column_exponents' table, kept from call to call
    if (int64_t(exps.size()) < 16 * groups) exps.resize(16 * groups);
    uint32_t* e16 = exps.data();
    for (int c0 = 0; c0 < NB; c0 += 16) {
        const int live = std::clamp(cols - c0, 0, 16);
        const uint8_t* w = j.w + (n0 + c0) * j.row_bytes;
        column_exponents(j, n0 + c0, live, groups, e16);
        for (int64_t p0 = 0; p0 < k2p; p0 += STEP) {
            __m512i v[16];
            load_transposed(v, live, bytes64((B == 2 ? j.k : k2) - B * p0),
                            [&](int c) { return w + c * j.row_bytes + B * p0; });
            const int qs = int(std::min<int64_t>(16, (k2p - p0 + PER_DWORD - 1) / PER_DWORD));
            for (int q = 0; q < qs; q++) {
                const int64_t p = p0 + PER_DWORD * q, g = std::min(p / group, groups - 1);  // pairs past k2: zero
                const __m512i e = _mm512_loadu_si512(e16 + 16 * g);
                for (int t = 0; t < PER_DWORD && p + t < k2p; t++) {
                    __mmask32 scaled;
                    const __m512i pair = codes.pair(v[q], t, scaled);
                    _mm512_storeu_si512(panel + (p + t) * NB + c0, _mm512_mask_add_epi16(pair, scaled, pair, e));
                }
            }
        }
    }
}

// Rows [n0, n0 + cols) of W, decoded with their scales (bitwise the reference's dequantisation, AVX-512) through
// `rows` (16 x row_words(k2p) floats), into the panel of `k2p` >= k2 pairs: dword p * NB + c holds row n0 + c's
// values 2p and 2p + 1 in bf16 (their high halves: exact), zero past the row (odd K, pairs k2 .. k2p) and past
// `cols`: FP4 and FP8 in blocks of a multiple of 32 straight from the codes (panel_of_codes); other blocks sixteen
// rows at a time through `rows`, sixteen pairs of each made one vector (a word permute) and transposed.
AVX512BF16 void decode_panel(const Job& j, int64_t n0, int cols, float* rows, uint32_t* panel, int64_t k2,
                             int64_t k2p) {
    if (j.fmt == FMT_FP4 && j.block % 32 == 0) return panel_of_codes<Fp4Codes>(j, n0, cols, panel, k2, k2p);
    if (j.fmt == FMT_FP8 && j.block % 32 == 0) return panel_of_codes<Fp8Codes>(j, n0, cols, panel, k2, k2p);
    const int64_t words = row_words(k2p);
    const __m512i odd = high_halves();
    for (int c0 = 0; c0 < NB; c0 += 16) {
        for (int c = 0; c < 16; c++) {
            float* row = rows + c * words;
            const int64_t r = n0 + c0 + c;
            if (c0 + c >= cols) {
                std::memset(row, 0, sizeof(float) * words);
                continue;
            }
            const uint8_t* src = j.w + r * j.row_bytes;
            const int64_t srow = j.fmt == FMT_FP8 ? r / j.block : r;
            for (int64_t c0k = 0, g = 0; c0k < j.k; c0k += j.block, g++)
                decode_block(j.fmt, 2, src, row, c0k, std::min(c0k + j.block, j.k), scale_at(j, srow, g));
            std::memset(row + j.k, 0, sizeof(float) * (words - j.k));
        }
        int64_t p0 = 0;
        for (; p0 + 16 <= k2p; p0 += 16) {
            __m512i v[16];
            for (int c = 0; c < 16; c++) {
                const float* f = rows + c * words + 2 * p0;
                v[c] = _mm512_permutex2var_epi16(_mm512_loadu_si512(f), odd, _mm512_loadu_si512(f + 16));
            }
            transpose16(v);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(panel + (p0 + p) * NB + c0, v[p]);
        }
        for (; p0 < k2p; p0++)
            for (int c = 0; c < 16; c++) {
                const float* f = rows + c * words + 2 * p0;
                panel[p0 * NB + c0 + c] = (bits_of(f[0]) >> 16) | (bits_of(f[1]) & 0xFFFF0000u);
            }
    }
}

// R rows of x (bf16 pairs, `k2` a row) by the panel's NB columns into y (`ldy` a row; `cols` of them stored). The
// first `lines` cache lines from `ahead` (at most k2) are asked for into L2, one a pair.
template <int R>
AVX512BF16 void tile(const uint32_t* a, int64_t k2, const uint32_t* panel, float* y, int64_t ldy, int cols,
                     const char* ahead, int64_t lines) {
    __m512 acc0[R], acc1[R];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k2; p++) {
        if (p < lines) _mm_prefetch(ahead + 64 * p, _MM_HINT_T1);
        const __m512bh b0 = avx512bf16::as_bh(_mm512_loadu_si512(panel + p * NB));
        const __m512bh b1 = avx512bf16::as_bh(_mm512_loadu_si512(panel + p * NB + 16));
        for (int r = 0; r < R; r++) {
            const __m512bh av = avx512bf16::as_bh(_mm512_set1_epi32(int(a[r * k2 + p])));
            acc0[r] = _mm512_dpbf16_ps(acc0[r], av, b0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], av, b1);
        }
    }
    const __mmask16 m0 = avx512::tail16(cols), m1 = avx512::tail16(cols > 16 ? cols - 16 : 0);
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, acc0[r]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc1[r]);
    }
}

// tile<left> for a `left` of at most R rows.
template <int R>
AVX512BF16 INLINE void tile_rest(int64_t left, const uint32_t* a, int64_t k2, const uint32_t* panel, float* y,
                                 int64_t ldy, int cols, const char* ahead, int64_t lines) {
    if constexpr (R > 0) {
        if (left == R) return tile<R>(a, k2, panel, y, ldy, cols, ahead, lines);
        tile_rest<R - 1>(left, a, k2, panel, y, ldy, cols, ahead, lines);
    }
}

// m rows of x by the panel (tile: MR rows at a time, then the rest), the first tile asking for `lines` cache lines
// from `ahead` (the next panel's codes, so that its decode finds them in L2: a panel's codes out of DRAM, 16 rows
// interleaved, came at ~5 GB/s a core against ~12 out of L3).
AVX512BF16 void tiles(const uint32_t* a, int64_t m, int64_t k2, const uint32_t* panel, float* y, int64_t ldy,
                      int cols, const char* ahead, int64_t lines) {
    int64_t m0 = 0;
    for (; m0 + MR <= m; m0 += MR, lines = 0) tile<MR>(a + m0 * k2, k2, panel, y + m0 * ldy, ldy, cols, ahead, lines);
    const int64_t left = m - m0;
    if (left) tile_rest<MR - 1>(left, a + m0 * k2, k2, panel, y + m0 * ldy, ldy, cols, ahead, lines);
}

// Output rows n0..n1 of a job whose x is in bf16 pairs (j.xp, k2 a row: prepare_x, mhc_qgemm_bf16) by the panels:
// each block of NB rows decoded once (decode_panel) and multiplied into every row of x (tiles). False where this
// thread's scratch cannot grow (nothing written).
AVX512BF16 bool run_job(const Job& j, int64_t n0, int64_t n1) {
    const int64_t k2 = (j.k + 1) / 2;
    uint32_t* panel = scratch<uint32_t>(NB * k2);
    float* rows = scratch<float>(16 * row_words(k2));
    if (!panel || !rows) return false;
    for (int64_t c0 = n0; c0 < n1; c0 += NB) {
        const int cols = n1 - c0 < NB ? int(n1 - c0) : NB;
        decode_panel(j, c0, cols, rows, panel, k2, k2);
        const int64_t next = std::clamp<int64_t>(n1 - c0 - NB, 0, NB);  // the next panel's rows
        const char* ahead = next ? reinterpret_cast<const char*>(j.w + (c0 + NB) * j.row_bytes) : nullptr;
        tiles(j.xp, j.m, k2, panel, j.y + c0, j.n, cols, ahead, std::min(k2, (next * j.row_bytes + 63) / 64));
    }
    return true;
}

}  // namespace gemm

// ---------------------------------------------------------------- AMX: the same GEMM by tile dot products
// The panels above are already the B operand of an AMX tile (16 pairs of K a tile row, 16 columns of 4 bytes), and x
// in bf16 pairs its A operand. TDPBF16PS multiplies bf16 pairs exactly into fp32 sums with subnormals flushed, as
// vdpbf16ps does, so the same x and scales qualify (gemm::pack_row, gemm::scales_take); only the order of the fp32
// sums differs. Each thread decodes a group of panels (at most ~1 MB, kept in its L2) and multiplies every block of
// 32 rows of x by each of them: 8 tiles, two of x, two of the panel, four of sums (32 x 32).

namespace amx {

constexpr int MT = 32;               // rows of x a block (two A tiles)
constexpr int KT = 16;               // pairs of K a tile step
constexpr int64_t GROUP_BYTES = 1 << 20;

// Whether this CPU has AMX tiles with BF16 (CPUID leaf 7: EDX bits 22, 24) and Linux lets this process use them
// (arch_prctl ARCH_REQ_XCOMP_PERM for the tile data, XFEATURE 18), asked once per process.
bool usable() {
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
        return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }();
    return ok;
}

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// This thread's tiles: eight of 64 bytes a row (tiles 0-3 sums, 4-5 x: `rows` rows, at most 16; 6-7 the panel: 16).
AMX void configure(int rows) {
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = t < 6 ? uint8_t(rows) : 16;
    _tile_loadconfig(&c);
}

// x as the A tiles take it: block of 32 rows mb, tile step kb (16 pairs) holds rows 0..31 of 16 pairs each,
// contiguous (1 KB, so that a tile's 16 rows are 64 bytes apart, not a row of x apart: rows of x 4 KB apart share
// an L1 set), `steps` of them a block. Where row r's chunk 0 starts; its chunks are TILE_WORDS apart.
constexpr int64_t TILE_WORDS = MT * KT;
inline int64_t row_at(int64_t r, int64_t steps) { return (r / MT) * steps * TILE_WORDS + (r % MT) * KT; }

// out [32, 32] (`ldo` floats a row) = a block of 32 rows of x (`steps` tile steps: see row_at) . the panel's 32
// columns.
AMX void block(const uint32_t* a, int64_t steps, const uint32_t* panel, float* out, int64_t ldo) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0, p = 0; s < steps; s++, p += KT) {
        _tile_loadd(4, a + s * TILE_WORDS, KT * 4);
        _tile_loadd(5, a + s * TILE_WORDS + 16 * KT, KT * 4);
        _tile_loadd(6, panel + p * gemm::NB, gemm::NB * 4);
        _tile_loadd(7, panel + p * gemm::NB + 16, gemm::NB * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, ldo * 4);
    _tile_stored(1, out + 16, ldo * 4);
    _tile_stored(2, out + 16 * ldo, ldo * 4);
    _tile_stored(3, out + 16 * ldo + 16, ldo * 4);
}

// out [rows, 32] = the first `rows` <= 16 rows of a block of x . the panel's 32 columns: two sum tiles of `rows`
// rows (the configuration's), one of x: a chunk of few rows (a routed expert's tokens) takes half the tile
// products, and fewer rows each, of a whole block.
AMX void half_block(const uint32_t* a, int64_t steps, const uint32_t* panel, float* out, int64_t ldo) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t s = 0, p = 0; s < steps; s++, p += KT) {
        _tile_loadd(4, a + s * TILE_WORDS, KT * 4);
        _tile_loadd(6, panel + p * gemm::NB, gemm::NB * 4);
        _tile_loadd(7, panel + p * gemm::NB + 16, gemm::NB * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, out, ldo * 4);
    _tile_stored(1, out + 16, ldo * 4);
}

// y [m, n] = a (x as bf16 pairs in tile order (row_at), mp rows (a multiple of MT, zero past m) of k2p pairs) . W^T
// on `threads` threads.
// Returns 0, 4 (out of memory) or 5 (a thread flushes subnormals).
AMX int multiply(const Job& j, const uint32_t* a, int64_t mp, int64_t k2, int64_t k2p, int threads) {
    const int64_t panels = (j.n + gemm::NB - 1) / gemm::NB, panel_words = gemm::NB * k2p;
    const int64_t per_group = std::clamp<int64_t>(GROUP_BYTES / std::max<int64_t>(1, panel_words * 4), 1,
                                                  std::clamp<int64_t>(panels / threads, 1, 8));  // every thread busy
    const int64_t groups = (panels + per_group - 1) / per_group;
    int oom = 0, flush = 0;
    const unsigned caller = _mm_getcsr();
#pragma omp parallel num_threads(threads) reduction(| : oom, flush)
    {
        flush |= take_caller_mode(caller);
        uint32_t* pans = gemm::scratch<uint32_t>(per_group * panel_words);
        float* row = gemm::scratch<float>(16 * gemm::row_words(k2p));
        alignas(64) float edge[MT * gemm::NB];
        oom |= pans && row ? 0 : 1;
        const bool few = j.m <= 16;  // one block of x, its first rows only: tiles of j.m rows
        configure(few ? int(std::max<int64_t>(1, j.m)) : 16);
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < groups; g++) {
            if (oom || flush) continue;
            const int64_t p0 = g * per_group, p1 = std::min(panels, p0 + per_group);
            for (int64_t pi = p0; pi < p1; pi++) {
                const int64_t n0 = pi * gemm::NB;
                gemm::decode_panel(j, n0, int(std::min<int64_t>(gemm::NB, j.n - n0)), row,
                                   pans + (pi - p0) * panel_words, k2, k2p);
            }
            for (int64_t m0 = 0; m0 < mp; m0 += MT)
                for (int64_t pi = p0; pi < p1; pi++) {
                    const int64_t n0 = pi * gemm::NB;
                    const int64_t rows = std::min<int64_t>(MT, j.m - m0), cols = std::min<int64_t>(gemm::NB, j.n - n0);
                    const uint32_t* panel = pans + (pi - p0) * panel_words;
                    const uint32_t* am = a + row_at(m0, k2p / KT);
                    const bool whole = !few && rows == MT && cols == gemm::NB;  // straight into y
                    float* out = whole ? j.y + m0 * j.n + n0 : edge;
                    (few ? half_block : block)(am, k2p / KT, panel, out, whole ? j.n : gemm::NB);
                    for (int64_t r = 0; r < rows && !whole; r++)
                        std::memcpy(j.y + (m0 + r) * j.n + n0, edge + r * gemm::NB, sizeof(float) * cols);
                }
        }
        _tile_release();
    }
    return oom ? 4 : flush ? 5 : 0;
}

}  // namespace amx

// ---------------------------------------------------------------- AVX2 (+F16C, FMA): the same sums, 8 lanes
// Tails (a tile, group or row that ends inside a vector) are copied into zero-padded buffers and take the same
// vector step.

namespace avx2 {

// fp8: 32 e4m3 bytes at w into the partial sums p of each row of x (x pointers already at k; C chains a row), eight
// values at a time by e4m3_x8; x comes scaled by 2**112 (scale_x), so each product is the one of x and the value times
// 2**-8, exactly as the fp16 decode of the AVX-512 rows gives it. NaN codes noted in `nan`.
template <int R, int C>
AVX2 INLINE void fp8_step32(const uint8_t* w, const float* const* xk, __m256 (&p)[R][C], __m256i& nan) {
    const __m256i m7f = _mm256_set1_epi8(0x7F);
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    nan = _mm256_or_si256(nan, _mm256_cmpeq_epi8(_mm256_and_si256(b, m7f), m7f));
    const __m256 v[4] = {e4m3_x8(w), e4m3_x8(w + 8), e4m3_x8(w + 16), e4m3_x8(w + 24)};  // inputs 8i .. 8i + 8
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 4; i++) p[r][i % C] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xk[r] + 8 * i), p[r][i % C]);
}

// x rows [rows, k] -> xs [rows, k] times 2**(112 - e), e the job's x_exp: 0, or as much as keeps the largest finite
// |x| below 2**127 (|x| >= 2**16, which no activation the model makes reaches; then each product is 2**-e times
// fp8_step32's usual one and may round differently where that makes it subnormal). Returns e.
AVX2 int scale_x(const float* x, float* xs, int64_t rows, int64_t k) {
    const int64_t count = rows * k;
    float top = 0.0f;
    for (int64_t i = 0; i < count; i++)
        if (std::isfinite(x[i])) top = std::max(top, std::fabs(x[i]));
    const int e = top >= 0x1p16f ? std::ilogb(top) - 15 : 0;
    const __m256 f = _mm256_set1_ps(std::ldexp(1.0f, 112 - e));
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(xs + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), f));
    for (; i < count; i++) xs[i] = x[i] * std::ldexp(1.0f, 112 - e);
    return e;
}

AVX2 INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The `len` (< width) values left at w / xs[r] + k, zero-padded into buffers, and pointers to them.
template <int R>
struct Tail {
    alignas(32) uint8_t w[32] = {};
    alignas(32) float x[R][32] = {};
    const float* xp[R];
    Tail(const uint8_t* src, int64_t bytes, const float* const* xs, int64_t k, int64_t len) {
        std::memcpy(w, src, bytes);
        for (int r = 0; r < R; r++) {
            std::memcpy(x[r], xs[r] + k, sizeof(float) * len);
            xp[r] = x[r];
        }
    }
};

// fp8 row n: tiles of `block` inputs, 32 bytes at a time into C chains a row of x (4 for one or two rows, 2 for
// more: registers), each tile's sum times its scale. Returns whether a NaN code was seen.
template <int R>
AVX2 bool fp8_row(const Job& j, int64_t n, const float* const* xs, float* out) {
    constexpr int C = R <= 2 ? 4 : 2;
    const uint8_t* w = j.w + n * j.row_bytes;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    __m256i nan = _mm256_setzero_si256();
    const int64_t tile_row = n / j.block;
    for (int64_t k0 = 0, c = 0; k0 < j.k; k0 += j.block, c++) {
        const int64_t k1 = k0 + j.block < j.k ? k0 + j.block : j.k;
        __m256 p[R][C];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < C; i++) p[r][i] = _mm256_setzero_ps();
        int64_t k = k0;
        if (k1 - k0 == 128) {  // DeepSeek's tiles: four steps, no loop
            prefetch_ahead(w + k);
            prefetch_ahead(w + k + 64);
            for (int t = 0; t < 4; t++, k += 32) {
                const float* xk[R];
                for (int r = 0; r < R; r++) xk[r] = xs[r] + k;
                fp8_step32<R, C>(w + k, xk, p, nan);
            }
        }
        for (; k + 32 <= k1; k += 32) {
            if (!(k & 63)) prefetch_ahead(w + k);
            const float* xk[R];
            for (int r = 0; r < R; r++) xk[r] = xs[r] + k;
            fp8_step32<R, C>(w + k, xk, p, nan);
        }
        if (k < k1) {
            Tail<R> t(w + k, k1 - k, xs, k, k1 - k);
            fp8_step32<R, C>(t.w, t.xp, p, nan);
        }
        const __m256 s = _mm256_set1_ps(scale_at(j, tile_row, c) * 256.0f);
        for (int r = 0; r < R; r++) {
            __m256 sum = p[r][0];
            for (int i = 1; i < C; i++) sum = _mm256_add_ps(sum, p[r][i]);
            acc[r] = _mm256_fmadd_ps(sum, s, acc[r]);
        }
    }
    const float undo = j.x_exp ? std::ldexp(1.0f, j.x_exp) : 1.0f;
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) * undo;
    return _mm256_movemask_epi8(nan) != 0;
}

// fp4, 32 bytes (64 inputs) at a time, no conversion instruction: e2m1 values are bf16 values, so each nibble
// indexes two 16-entry byte tables (its value's bf16 high and low bytes: exact), byte pairs interleave into bf16
// (unpack), and each bf16 becomes fp32 by a shift (the even one of a 32-bit lane) or a mask (the odd one). x is
// permuted beforehand into the order these vectors hold their inputs (fp4_permute). The two 16-byte halves of
// the step are 32 inputs each, inside one group (block % 32 == 0), so their partial sums meet their groups'
// scales as one vector `sv`; each row of x alternates two accumulators between steps.
alignas(16) const int8_t FP4_BF16_HI[16] = {0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                            -0x80, -0x41, -0x41, -0x41, -0x40, -0x40, -0x40, -0x40};
alignas(16) const int8_t FP4_BF16_LO[16] = {0x00, 0x00, -0x80, -0x40, 0x00, 0x40, -0x80, -0x40,
                                            0x00, 0x00, -0x80, -0x40, 0x00, 0x40, -0x80, -0x40};

template <int R>
AVX2 INLINE void fp4_step32(const uint8_t* w, const float* const* xp, __m256 sv, __m256 (&acc)[R]) {
    const __m256i hi_t = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(FP4_BF16_HI)));
    const __m256i lo_t = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(FP4_BF16_LO)));
    const __m256i m0f = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i even = _mm256_and_si256(b, m0f), odd = _mm256_and_si256(_mm256_srli_epi16(b, 4), m0f);
    const __m256i eh = _mm256_shuffle_epi8(hi_t, even), el = _mm256_shuffle_epi8(lo_t, even);
    const __m256i oh = _mm256_shuffle_epi8(hi_t, odd), ol = _mm256_shuffle_epi8(lo_t, odd);
    const __m256i bf[4] = {_mm256_unpacklo_epi8(el, eh), _mm256_unpackhi_epi8(el, eh), _mm256_unpacklo_epi8(ol, oh),
                           _mm256_unpackhi_epi8(ol, oh)};
    __m256 v[8];
    for (int i = 0; i < 4; i++) {
        v[2 * i] = _mm256_castsi256_ps(_mm256_slli_epi32(bf[i], 16));
        v[2 * i + 1] = _mm256_castsi256_ps(_mm256_and_si256(bf[i], top));
    }
    for (int r = 0; r < R; r++) {
        __m256 p = _mm256_mul_ps(v[0], _mm256_loadu_ps(xp[r]));
        __m256 q = _mm256_mul_ps(v[1], _mm256_loadu_ps(xp[r] + 8));
        for (int i = 2; i < 8; i += 2) {
            p = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xp[r] + 8 * i), p);
            q = _mm256_fmadd_ps(v[i + 1], _mm256_loadu_ps(xp[r] + 8 * i + 8), q);
        }
        acc[r] = _mm256_fmadd_ps(_mm256_add_ps(p, q), sv, acc[r]);
    }
}

// Where fp4_step32 wants input `i` (< 64) of a step, as an index into its 64 x values (v[q] meets x[8q .. 8q+8)).
// Input 2t + h (byte t < 32 of the step, h = 0 the low nibble, 1 the high one) is element 4 * half + e of v[4h +
// 2 * part + sub], where t = 16 * half + 8 * part + 2 * e + sub: half the 16-byte lane, part the unpack (low or
// high 8 bytes of the lane), e the 32-bit lane of the bf16 pair, sub its shifted (0) or masked (1) half.
inline int fp4_slot(int i) {
    const int t = i / 2, h = i % 2, half = t / 16, part = (t % 16) / 8, e = (t % 8) / 2, sub = t % 2;
    return 8 * (4 * h + 2 * part + sub) + 4 * half + e;
}

// x rows [rows, k] -> xp [rows, kpad] (kpad = k rounded up to 64) in fp4_step32's order, zero-padded.
void fp4_permute(const float* x, float* xp, int64_t rows, int64_t k, int64_t kpad) {
    int slot[64];
    for (int i = 0; i < 64; i++) slot[i] = fp4_slot(i);
    for (int64_t r = 0; r < rows; r++) {
        float* dst = xp + r * kpad;
        std::memset(dst, 0, sizeof(float) * kpad);
        for (int64_t i = 0; i < k; i++) dst[(i & ~int64_t(63)) + slot[i & 63]] = x[r * k + i];
    }
}

// fp4: the scales of lanes [l0, l0 + count) of row n, each four times over (out[4 i .. 4 i + 4): lane l0 + i, the
// inputs 32 l .. 32 l + 32, in group 32 l / block; 1 past the row), so that a 32-byte step reads its two lanes' as one
// vector. With DeepSeek's groups of 32, eight lanes at a time (e8m0 byte b: b << 23 is 2**(b - 127), but for 0:
// 2**-127, and 255: NaN, as e8m0() gives them); else lane by lane.
AVX2 void lane_scales(const Job& j, int64_t n, int64_t l0, int64_t count, float* out) {
    int64_t i = 0;
    if (j.block == 32) {
        const __m256i spread[4] = {_mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0), _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2),
                                   _mm256_set_epi32(5, 5, 5, 5, 4, 4, 4, 4), _mm256_set_epi32(7, 7, 7, 7, 6, 6, 6, 6)};
        const __m256i zero = _mm256_setzero_si256(), all = _mm256_set1_epi32(255);
        for (; i + 8 <= count && l0 + i + 8 <= j.s_cols; i += 8) {
            __m256 v;
            if (j.scale_kind == 1) {
                v = _mm256_loadu_ps(static_cast<const float*>(j.s) + n * j.s_cols + l0 + i);
            } else {
                const uint8_t* bytes = static_cast<const uint8_t*>(j.s) + n * j.s_cols + l0 + i;
                const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
                v = _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
                v = _mm256_blendv_ps(v, _mm256_set1_ps(0x1p-127f), _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, zero)));
                v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, all)));
            }
            for (int q = 0; q < 4; q++) _mm256_store_ps(out + 4 * i + 8 * q, _mm256_permutevar8x32_ps(v, spread[q]));
        }
    }
    for (; i < count; i++) {
        const int64_t l = l0 + i;
        _mm_store_ps(out + 4 * i, _mm_set1_ps(l * 32 < j.k ? scale_at(j, n, l * 32 / j.block) : 1.0f));
    }
}

// fp4: the scales of step s's two lanes (as lane_scales writes them): where `direct` (e8m0 bytes, a group of 32 each,
// filling the row's steps) from the row's bytes sb by the e8m0 table (two loads, one insert: converting a segment's
// scales ahead of its steps took ~15% of an FP4 expert's time), else from lane_scales' copy sc of the segment that
// begins at step s0.
AVX2 INLINE __m256 step_scales(bool direct, const uint8_t* sb, const float* sc, int64_t s, int64_t s0) {
    if (!direct) return _mm256_load_ps(sc + 8 * (s - s0));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(&E8M0.v[sb[2 * s]])),
                                _mm_broadcast_ss(&E8M0.v[sb[2 * s + 1]]), 1);
}

constexpr int64_t SEG_STEPS = 128;  // fp4: 32-byte steps whose scales a row converts at a time (8,192 inputs)

// fp4 row n: 32-byte steps (64 inputs, two lanes) by `step` (a struct whose run<R>(w, b, sv, acc) takes the bytes at w,
// b from the row's start, with the two lanes' scales sv), alternating two accumulators; the last bytes of a row that
// ends inside a step zero-padded (x is zero past the row).
template <int R, class Step>
AVX2 INLINE void fp4_steps(const Job& j, int64_t n, const Step& step, float* out) {
    const uint8_t* w = j.w + n * j.row_bytes;
    const int64_t bytes = j.k / 2, steps = (bytes + 31) / 32;
    alignas(32) float sc[8 * SEG_STEPS];
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    const bool direct = j.block == 32 && j.scale_kind == 0 && j.s_cols == 2 * steps;
    const uint8_t* sb = static_cast<const uint8_t*>(j.s) + n * j.s_cols;
    for (int64_t s0 = 0; s0 < steps; s0 += SEG_STEPS) {
        const int64_t s1 = s0 + SEG_STEPS < steps ? s0 + SEG_STEPS : steps;
        if (!direct) lane_scales(j, n, 2 * s0, 2 * (s1 - s0), sc);
        int64_t s = s0;
        for (; s + 2 <= s1 && 32 * (s + 2) <= bytes; s += 2) {
            prefetch_ahead(w + 32 * s);
            step.template run<R>(w + 32 * s, 32 * s, step_scales(direct, sb, sc, s, s0), a0);
            step.template run<R>(w + 32 * s + 32, 32 * s + 32, step_scales(direct, sb, sc, s + 1, s0), a1);
        }
        for (; s < s1; s++) {
            alignas(32) uint8_t t[32] = {};
            const bool whole = 32 * (s + 1) <= bytes;
            if (!whole) std::memcpy(t, w + 32 * s, bytes - 32 * s);
            step.template run<R>(whole ? w + 32 * s : t, 32 * s, step_scales(direct, sb, sc, s, s0), a0);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
}

// fp4 by fp32 FMAs (fp4_step32), x in fp4_permute's order.
struct Fp32Fp4Step {
    const float* const* xs;
    template <int R>
    AVX2 INLINE void run(const uint8_t* w, int64_t b, __m256 sv, __m256 (&acc)[R]) const {
        const float* xp[R];
        for (int r = 0; r < R; r++) xp[r] = xs[r] + 2 * b;
        fp4_step32<R>(w, xp, sv, acc);
    }
};

template <int R>
AVX2 void fp4_row(const Job& j, int64_t n, const float* const* xs, float* out) {
    fp4_steps<R>(j, n, Fp32Fp4Step{xs}, out);
}

// fp4 by 16-bit integer dot products (vpmaddwd), x as integers (make_int_x, in fp4_int_slot's order): each nibble
// indexes a 16-entry table of twice its value as a signed byte, and the byte is moved (a shift) or masked into the high
// byte of an int16 whose low byte is zero: the weights come as 256 times their integers (x's chunk scale takes the
// 2**-8), two instructions a vector where two more table lookups and an unpack of the low and high bytes took three.
// The fp32 rows above also shift or mask each value to fp32 and multiply fp32 x (twice the bytes of int16 x): 5.8
// against 10.6 TSC ticks a 32-byte step in cache on a Zen 3 core, before the shifts.
alignas(16) const int8_t FP4_INT_LO[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int FP4_INT_UNIT = 8;  // the weights' int16 are 2**8 times twice their values

// Where IntFp4Step wants input i (< 128) of a chunk (two 32-byte steps of 64 inputs), as an index into the chunk's 128
// int16: byte t < 32 of a step holds inputs 2t (low nibble) and 2t + 1 (high nibble); word e < 16 of the four vectors
// fp4_int_words makes holds byte 2e's low nibble (vector 0), byte 2e + 1's (1), byte 2e's high nibble (2) and byte
// 2e + 1's (3): inputs 4e, 4e + 2, 4e + 1, 4e + 3.
inline int fp4_int_slot(int i) {
    const int step = i / 64, e = (i % 64) / 4, o = i % 4;
    static constexpr int vec[4] = {0, 2, 1, 3};
    return 64 * step + 16 * vec[o] + e;
}

// 32 bytes (64 inputs: the 16-byte lane L holds group L of the step's two) -> four vectors of 16 int16 weights.
AVX2 INLINE void fp4_int_words(const uint8_t* w, __m256i (&v)[4]) {
    const __m256i lo_t = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(FP4_INT_LO)));
    const __m256i m0f = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi16(int16_t(0xFF00));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i even = _mm256_and_si256(b, m0f), odd = _mm256_and_si256(_mm256_srli_epi16(b, 4), m0f);
    const __m256i el = _mm256_shuffle_epi8(lo_t, even), ol = _mm256_shuffle_epi8(lo_t, odd);
    v[0] = _mm256_slli_epi16(el, 8), v[1] = _mm256_and_si256(el, high);
    v[2] = _mm256_slli_epi16(ol, 8), v[3] = _mm256_and_si256(ol, high);
}

// The four weight vectors against 64 int16 of x, summed per 32-bit lane in int32 (eight products: exact) -> fp32 (exact).
AVX2 INLINE __m256 int_dot(const __m256i (&v)[4], const int16_t* x) {
    const __m256i* xv = reinterpret_cast<const __m256i*>(x);
    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(v[0], _mm256_loadu_si256(xv)),
                                       _mm256_madd_epi16(v[1], _mm256_loadu_si256(xv + 1)));
    const __m256i q = _mm256_add_epi32(_mm256_madd_epi16(v[2], _mm256_loadu_si256(xv + 2)),
                                       _mm256_madd_epi16(v[3], _mm256_loadu_si256(xv + 3)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(p, q));
}

// fp4 by vpmaddwd: the 32 bytes at w, b from the row's start (chunk b / 64 of x, its half b % 64 / 32), against x's
// integer windows (TWO: the chunks that take two do, else every chunk takes one; a branch a step costs ~12%). Each
// row's chunks take their own number of windows (a prefill's experts' ~12 rows would take two in most chunks if any
// row's chunk did).
template <bool TWO>
struct IntFp4Step {
    const int16_t* const* xs;
    const float* xsc[MB];    // each row's chunk scales
    const uint8_t* two[MB];  // and whether its chunk takes two windows
    template <int R>
    AVX2 INLINE void run(const uint8_t* w, int64_t b, __m256 sv, __m256 (&acc)[R]) const {
        __m256i v[4];
        fp4_int_words(w, v);
        const int64_t c = b / 64, at = c * 2 * INT_CHUNK + (b % 64) * 2;
        for (int r = 0; r < R; r++) {
            __m256 f = int_dot(v, xs[r] + at);
            if (TWO && two[r][c]) f = _mm256_fmadd_ps(int_dot(v, xs[r] + at + INT_CHUNK), _mm256_set1_ps(0x1p15f), f);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(f, _mm256_set1_ps(xsc[r][c])), sv, acc[r]);
        }
    }
};

// fp4 row n by vpmaddwd a chunk of x (128 inputs, two 32-byte steps) at a time, for rows whose scales are e8m0 bytes
// a group of 32 and whose inputs fill whole chunks (DeepSeek's experts): each step's products times its two groups'
// scales summed into the chunk's, which takes x's chunk scale once.
template <int R, bool TWO>
AVX2 INLINE void fp4_int_chunks(const Job& j, int64_t n, const int16_t* const* xs, const float* const* xsc,
                                const uint8_t* const* two, float* out) {
    const uint8_t* w = j.w + n * j.row_bytes;
    const uint8_t* sb = static_cast<const uint8_t*>(j.s) + n * j.s_cols;
    // the scales of the row 8 rows on, asked for now: a row's scales are one line apart from the next row's, a stream
    // the weights' prefetch does not cover (a decode routed call out of DRAM 0.96-0.99x the time)
    _mm_prefetch(reinterpret_cast<const char*>(sb + 8 * j.s_cols), _MM_HINT_T0);
    const int64_t chunks = j.k / INT_CHUNK;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; c++, w += 64) {
        prefetch_ahead(w);
        __m256 part[R];
        for (int h = 0; h < 2; h++) {  // a step's words dead before the next step's (both at once spilled registers)
            __m256i v[4];
            fp4_int_words(w + 32 * h, v);
            const __m256 sv = step_scales(true, sb, nullptr, 2 * c + h, 0);
            for (int r = 0; r < R; r++) {
                const int16_t* x = xs[r] + c * 2 * INT_CHUNK + 64 * h;
                __m256 f = int_dot(v, x);
                if (TWO && two[r][c]) f = _mm256_fmadd_ps(int_dot(v, x + INT_CHUNK), _mm256_set1_ps(0x1p15f), f);
                part[r] = h ? _mm256_fmadd_ps(f, sv, part[r]) : _mm256_mul_ps(f, sv);
            }
        }
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(part[r], _mm256_set1_ps(xsc[r][c]), acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

template <int R>
AVX2 void fp4_int_row(const Job& j, int64_t n, const int16_t* const* xs, float* out) {
    IntFp4Step<true> two{xs, {}, {}};
    IntFp4Step<false> one{xs, {}, {}};
    bool any = false;
    for (int r = 0; r < R; r++) {
        const int64_t at = (xs[r] - j.xi) / (2 * INT_CHUNK);  // the row's first chunk (a shift, no division)
        one.xsc[r] = two.xsc[r] = j.xi_scale + at, two.two[r] = j.xi_two + at;
        any |= j.xi_any_two[at] != 0;
    }
    const bool chunked = j.block == 32 && j.scale_kind == 0 && j.s_cols == j.k / 32 && j.k % INT_CHUNK == 0;
    if (chunked && any) fp4_int_chunks<R, true>(j, n, xs, two.xsc, two.two, out);
    else if (chunked) fp4_int_chunks<R, false>(j, n, xs, two.xsc, two.two, out);
    else if (any) fp4_steps<R>(j, n, two, out);
    else fp4_steps<R>(j, n, one, out);
}

// ---- fp4 panels: many rows of x (a prefill's experts) against weights decoded once
// A panel is PANEL weight rows decoded to int16 (twice their e2m1 values: -12..12) and laid out pair-major: for each
// pair t of inputs (2t, 2t + 1: one weight byte), two vectors of eight 32-bit words, word i = row i's (or i + 8's) two
// int16. Rows of x (make_int_x in input order, unit 0) then meet it four at a time: each pair of x broadcast, one
// vpmaddwd a vector, int32 sums over a group of 32 inputs (16 products of at most 12 * 2**15: exact, and below 2**24,
// so their fp32 is exact), then times the group's scales and x's chunk scale. Against the rows above, which decode each
// weight row for every four rows of x and reread x for every weight row, a pass reads 80 bytes a 128 products (not
// ~270) and keeps every register (the rows spilled).
constexpr int PANEL = 16;
constexpr int64_t PANEL_MIN_ROWS = 4;  // rows of x from which a job takes panels

// 8 x 8 dwords, r[c] holding row c's dwords 0..7, transposed in registers: r[p] then holds dword p of every row.
AVX2 INLINE void transpose8(__m256i (&r)[8]) {
    __m256i u[8];
    for (int i = 0; i < 8; i += 4) {  // u[i + j], 128-bit lane L: rows i .. i + 3 at dword 4L + j
        const __m256i a = _mm256_unpacklo_epi32(r[i], r[i + 1]), b = _mm256_unpackhi_epi32(r[i], r[i + 1]);
        const __m256i c = _mm256_unpacklo_epi32(r[i + 2], r[i + 3]), d = _mm256_unpackhi_epi32(r[i + 2], r[i + 3]);
        u[i] = _mm256_unpacklo_epi64(a, c), u[i + 1] = _mm256_unpackhi_epi64(a, c);
        u[i + 2] = _mm256_unpacklo_epi64(b, d), u[i + 3] = _mm256_unpackhi_epi64(b, d);
    }
    for (int j = 0; j < 4; j++)
        r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20),
        r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
}

// Byte p of each 32-bit word of a 16-byte lane into the high byte of the word's low half (A) or high half (B).
struct PanelMasks {
    alignas(32) int8_t a[4][32], b[4][32];
    PanelMasks() {
        for (int p = 0; p < 4; p++)
            for (int i = 0; i < 32; i++) {
                const int word = i / 4 % 4, at = i % 4;
                a[p][i] = at == 1 ? int8_t(4 * word + p) : int8_t(-128);
                b[p][i] = at == 3 ? int8_t(4 * word + p) : int8_t(-128);
            }
    }
};
const PanelMasks PANEL_MASKS;

// Eight rows' 32 bytes at `off` (pairs off .. off + 31) -> out[2 * t] for their pairs t (stride two vectors); the
// bytes `ahead` of them (the next panel's) fetched meanwhile: sixteen rows at once are more streams than the CPU's
// prefetcher follows (packing took twice as long without).
AVX2 INLINE void pack_panel8(const uint8_t* const* rows, int64_t off, int64_t ahead, __m256i* out) {
    __m256i r[8];
    for (int i = 0; i < 8; i++) {
        if (!(off & 63)) _mm_prefetch(reinterpret_cast<const char*>(rows[i] + off + ahead), _MM_HINT_T0);
        r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + off));
    }
    transpose8(r);  // r[q]: word q (bytes 4q .. 4q + 3: pairs 4q .. 4q + 3) of each row
    const __m256i lo_t = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(FP4_INT_LO)));
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    for (int q = 0; q < 8; q++) {
        const __m256i el = _mm256_shuffle_epi8(lo_t, _mm256_and_si256(r[q], m0f));
        const __m256i ol = _mm256_shuffle_epi8(lo_t, _mm256_and_si256(_mm256_srli_epi16(r[q], 4), m0f));
        for (int p = 0; p < 4; p++) {
            const __m256i* ma = reinterpret_cast<const __m256i*>(PANEL_MASKS.a[p]);
            const __m256i* mb = reinterpret_cast<const __m256i*>(PANEL_MASKS.b[p]);
            const __m256i a = _mm256_shuffle_epi8(el, _mm256_load_si256(ma));
            const __m256i b = _mm256_shuffle_epi8(ol, _mm256_load_si256(mb));
            _mm256_store_si256(out + 2 * (4 * q + p), _mm256_srai_epi16(_mm256_or_si256(a, b), 8));
        }
    }
}

// The e8m0 scales of a panel's rows (sbs: each row's bytes, `groups` of them) -> sc [groups][PANEL] fp32 by the e8m0
// table, eight groups of eight rows at a time (a transpose; one by one a panel's scales took ~6% of a routed call),
// the last groups one by one.
AVX2 INLINE void panel_scales(const uint8_t* const* sbs, int64_t groups, float* sc) {
    int64_t g0 = 0;
    for (; g0 + 8 <= groups; g0 += 8)
        for (int h = 0; h < PANEL / 8; h++) {
            __m256i v[8];
            for (int i = 0; i < 8; i++) {
                __m128i b = _mm_setzero_si128();
                std::memcpy(&b, sbs[8 * h + i] + g0, 8);
                v[i] = _mm256_castps_si256(_mm256_i32gather_ps(E8M0.v, _mm256_cvtepu8_epi32(b), 4));
            }
            transpose8(v);
            for (int g = 0; g < 8; g++)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc + (g0 + g) * PANEL + 8 * h), v[g]);
        }
    for (; g0 < groups; g0++)
        for (int i = 0; i < PANEL; i++) sc[g0 * PANEL + i] = E8M0.v[sbs[i][g0]];
}

// R rows of x (R <= 4) against group g's 16 pairs of the panel pw, x at `at` of each row: acc [R][16] (row r's
// sixteen outputs at acc + PANEL * r) += the int32 sums times scales sc (the group's, both vectors) times x's. The
// sums stay in registers over the group's pairs (unrolled); acc is read and written once a group, in memory (held in
// registers too, it spilled them inside the pairs' loop, which also copied eight registers a pair: 0.95-0.96x a
// prefill's routed call this way, BENCHMARKS.md).
template <int R>
AVX2 INLINE void panel_group(const __m256i* pw, const int16_t* const* xs, int64_t at, const float* sc, const float* xsc,
                             float* acc) {
    __m256i ia[R][2];
    for (int r = 0; r < R; r++) ia[r][0] = ia[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) {
        const __m256i wa = _mm256_load_si256(pw + 2 * t), wb = _mm256_load_si256(pw + 2 * t + 1);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            std::memcpy(&pair, xs[r] + at + 2 * t, 4);
            const __m256i xb = _mm256_set1_epi32(pair);
            ia[r][0] = _mm256_add_epi32(ia[r][0], _mm256_madd_epi16(wa, xb));
            ia[r][1] = _mm256_add_epi32(ia[r][1], _mm256_madd_epi16(wb, xb));
        }
    }
    const __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8);
    for (int r = 0; r < R; r++) {
        const __m256 f = _mm256_set1_ps(xsc[r]);
        float* a = acc + PANEL * r;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][0]), _mm256_mul_ps(s0, f), _mm256_loadu_ps(a)));
        _mm256_storeu_ps(a + 8,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][1]), _mm256_mul_ps(s1, f), _mm256_loadu_ps(a + 8)));
    }
}

// R rows of x from row m0 against groups [g0, g1) of the packed panel (pw, its scales sc [groups][16]), added to
// acc [R][16].
template <int R>
AVX2 void panel_rows(const Job& j, int64_t m0, const __m256i* pw, const float* sc, int64_t g0, int64_t g1, float* acc) {
    const int64_t chunks = j.k / INT_CHUNK;
    const int16_t* xs[R];
    for (int r = 0; r < R; r++) xs[r] = j.xi + (m0 + r) * j.x_stride;
    for (int64_t c = g0 / 4; c < g1 / 4; c++) {
        float xsc[R];
        for (int r = 0; r < R; r++) xsc[r] = j.xi_scale[(m0 + r) * chunks + c];
        for (int64_t g = 4 * c; g < 4 * c + 4; g++)
            panel_group<R>(pw + 32 * g, xs, c * 2 * INT_CHUNK + (g - 4 * c) * 32, sc + PANEL * g, xsc, acc);
        for (int r = 0; r < R; r++) {  // the bits below a split chunk's top window: its few tiny values, pair by pair
            const int split = j.xi_two[(m0 + r) * chunks + c];
            if (!split) continue;
            const int16_t* rest = xs[r] + c * 2 * INT_CHUNK + INT_CHUNK;
            const __m256 f = _mm256_set1_ps(std::ldexp(xsc[r], -split));
            uint64_t set = 0;  // the chunk's pairs whose rest is not zero
            for (int v = 0; v < INT_CHUNK / 16; v++) {
                const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rest) + v);
                const int zero = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(q, _mm256_setzero_si256())));
                set |= uint64_t(~zero & 0xFF) << (8 * v);
            }
            float* a = acc + PANEL * r;
            for (; set; set &= set - 1) {
                const int t = __builtin_ctzll(set);
                int32_t pair;
                std::memcpy(&pair, rest + 2 * t, 4);
                const int64_t p = c * INT_CHUNK / 2 + t, g = p / 16;
                const __m256i xb = _mm256_set1_epi32(pair);
                const __m256 d0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_load_si256(pw + 2 * p), xb));
                const __m256 d1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_load_si256(pw + 2 * p + 1), xb));
                _mm256_storeu_ps(a, _mm256_fmadd_ps(d0, _mm256_mul_ps(_mm256_loadu_ps(sc + PANEL * g), f),
                                                    _mm256_loadu_ps(a)));
                _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(d1, _mm256_mul_ps(_mm256_loadu_ps(sc + PANEL * g + 8), f),
                                                        _mm256_loadu_ps(a + 8)));
            }
        }
    }
}

constexpr int64_t PANEL_SPAN = 16;  // groups (512 inputs: 16 KB of a panel) that every row of x meets in turn

// Weight rows [n0, n1) of a panel job (prepare_x: fp4, e8m0 scales a group of 32, k a multiple of 128, one group of
// outputs) for every row of x, PANEL rows at a time (the last panel padded by repeating its last row), PANEL_SPAN
// groups at a time (that span of the panel stays in L1 while the rows of x pass).
AVX2 void run_panels(const Job& j, int64_t n0, int64_t n1) {
    const int64_t pairs = j.k / 2, groups = j.k / 32;
    std::vector<uint8_t> raw(pairs * 2 * 32 + 32);  // the panel, 32-byte aligned (std::vector does not align __m256i)
    __m256i* pw = reinterpret_cast<__m256i*>((reinterpret_cast<uintptr_t>(raw.data()) + 31) & ~uintptr_t(31));
    std::vector<float> sc(groups * PANEL), acc(j.m * PANEL);
    for (int64_t p0 = n0; p0 < n1; p0 += PANEL) {
        const int64_t live = n1 - p0 < PANEL ? n1 - p0 : PANEL;
        const uint8_t* rows[PANEL];
        const uint8_t* sbs[PANEL];
        for (int i = 0; i < PANEL; i++) {
            const int64_t n = p0 + (i < live ? i : live - 1);
            rows[i] = j.w + n * j.row_bytes;
            sbs[i] = static_cast<const uint8_t*>(j.s) + n * j.s_cols;
            _mm_prefetch(reinterpret_cast<const char*>(sbs[i] + PANEL * j.s_cols), _MM_HINT_T0);  // the next panel's
        }
        panel_scales(sbs, groups, sc.data());
        for (int h = 0; h < 2; h++)
            for (int64_t off = 0; off < pairs; off += 32)
                pack_panel8(rows + 8 * h, off, PANEL * j.row_bytes, pw + 2 * off + h);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t g0 = 0; g0 < groups; g0 += PANEL_SPAN) {
            const int64_t g1 = g0 + PANEL_SPAN < groups ? g0 + PANEL_SPAN : groups;
            for (int64_t m0 = 0; m0 < j.m; m0 += 4) {
                const int64_t left = j.m - m0;
                float* a = acc.data() + m0 * PANEL;
                if (left >= 4) panel_rows<4>(j, m0, pw, sc.data(), g0, g1, a);
                else if (left == 3) panel_rows<3>(j, m0, pw, sc.data(), g0, g1, a);
                else if (left == 2) panel_rows<2>(j, m0, pw, sc.data(), g0, g1, a);
                else panel_rows<1>(j, m0, pw, sc.data(), g0, g1, a);
            }
        }
        for (int64_t r = 0; r < j.m; r++) std::memcpy(j.y + r * j.n + p0, acc.data() + r * PANEL, sizeof(float) * live);
    }
}

// bf16, x split into its even and its odd inputs (split_x; as avx512::bf16_split_step): 16 weights (one 32-byte load)
// become their even inputs' fp32 values by a shift of each 32-bit lane and their odd ones' by a mask, no widening. xk
// points at the even inputs' eight; the odd ones' lie `half` after them.
template <int R>
AVX2 INLINE void bf16_split_step(const uint8_t* w, const float* const* xk, int64_t half, __m256 (&ae)[R],
                                 __m256 (&ao)[R]) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256 ev = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    const __m256 od = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(int(0xFFFF0000u))));
    for (int r = 0; r < R; r++) {
        ae[r] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(xk[r]), ae[r]);
        ao[r] = _mm256_fmadd_ps(od, _mm256_loadu_ps(xk[r] + half), ao[r]);
    }
}

// The half of bf16_row's split x (split_x): k / 2 rounded up to 8, each half zero-padded to it.
inline int64_t split_half(int64_t k) { return (k + 15) / 16 * 8; }

// bf16 row n (split x: split_x): C split steps a pass (64 weights for one row of x, 32 for two, 16 for more:
// registers), each into its own pair of chains; the last < 16 weights zero-padded. In cache a row of x takes 0.71-0.78x
// the time of the widening loop's two chains (a Zen 3 VM); out of DRAM (the head) both read at the memory's rate.
template <int R>
AVX2 void bf16_row(const Job& j, int64_t n, const float* const* xs, float* out) {
    constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
    const uint8_t* w = j.w + n * j.row_bytes;
    const int64_t half = j.x_stride / 2;
    __m256 ae[C][R], ao[C][R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) ae[c][r] = ao[c][r] = _mm256_setzero_ps();
    const float* xk[R];
    int64_t k = 0;
    for (; k + 16 * C <= j.k; k += 16 * C) {
        prefetch_ahead(w + 2 * k);
        if (C == 4) prefetch_ahead(w + 2 * k + 64);
        for (int c = 0; c < C; c++) {
            for (int r = 0; r < R; r++) xk[r] = xs[r] + k / 2 + 8 * c;
            bf16_split_step<R>(w + 2 * k + 32 * c, xk, half, ae[c], ao[c]);
        }
    }
    for (; k + 16 <= j.k; k += 16) {
        for (int r = 0; r < R; r++) xk[r] = xs[r] + k / 2;
        bf16_split_step<R>(w + 2 * k, xk, half, ae[0], ao[0]);
    }
    if (k < j.k) {  // the last < 16 weights zero-padded (x's halves are, up to their multiple of 8: split_x)
        alignas(32) uint8_t tw[32] = {};
        std::memcpy(tw, w + 2 * k, 2 * (j.k - k));
        for (int r = 0; r < R; r++) xk[r] = xs[r] + k / 2;
        bf16_split_step<R>(tw, xk, half, ae[0], ao[0]);
    }
    for (int r = 0; r < R; r++) {
        __m256 s = _mm256_add_ps(ae[0][r], ao[0][r]);
        for (int c = 1; c < C; c++) s = _mm256_add_ps(s, _mm256_add_ps(ae[c][r], ao[c][r]));
        out[r] = hsum(s);
    }
}

}  // namespace avx2

// The row functions of one instruction set, for run_row, and the x they read (row i of [M * G, x_stride]).
// Each also says whether a decode's job takes its rows four at a time (quads) and multiplies four (quad: the row
// functions with Q = 4, each row's result as with Q = 1), and returns false where it does not.
struct Avx512Rows {
    using X = float;
    static const X* x_of(const Job& j, int64_t i) { return j.x + i * j.x_stride; }
    template <int R> static bool fp8(const Job& j, int64_t n, const float* const* xs, float* out) {
        return avx512::fp8_row<R>(j, n, xs, out);
    }
    template <int R> static void fp4(const Job& j, int64_t n, const float* const* xs, float* out) {
        avx512::fp4_row<R>(j, n, xs, out);
    }
    template <int R> static void bf16(const Job& j, int64_t n, const float* const* xs, float* out) {
        avx512::bf16_row<R>(j, n, xs, out);
    }
    static bool quads(const Job& j) { return avx512::bf16_split(j); }
    static void quad(const Job& j, const int64_t* ns, const X* x, float* const* out) {
        avx512::bf16_split_rows<1, 4>(j, ns, &x, out);
    }
};

// FP8 rows through the bf16 tables (avx512bf16::fp8_rows), x in bf16 or in fp32: one row at a time or four.
template <class XT>
struct Fp8TableRows {
    using X = XT;
    template <int R> static bool fp8(const Job& j, int64_t n, const X* const* xs, float* out) {
        avx512bf16::fp8_rows<R, 1>(j, &n, xs, &out);
        return false;
    }
    static void quad(const Job& j, const int64_t* ns, const X* x, float* const* out) {
        avx512bf16::fp8_rows<1, 4>(j, ns, &x, out);
    }
};

struct Bf16Rows : Fp8TableRows<uint16_t> {
    static const X* x_of(const Job& j, int64_t i) { return j.xb + i * j.x_stride; }
    template <int R> static void fp4(const Job& j, int64_t n, const X* const* xs, float* out) {
        avx512bf16::fp4_row<R>(j, n, xs, out);
    }
    template <int R> static void bf16(const Job&, int64_t, const X* const*, float*) {}  // bf16 weights: fp32 rows
    static bool quads(const Job& j) { return j.fmt == FMT_FP8; }
};

struct F32Fp8Rows : Fp8TableRows<float> {  // FP8 weights only (prepare_x): isa 3 with x not exact in bf16
    static const X* x_of(const Job& j, int64_t i) { return j.x + i * j.x_stride; }
    template <int R> static void fp4(const Job&, int64_t, const X* const*, float*) {}
    template <int R> static void bf16(const Job&, int64_t, const X* const*, float*) {}
    static bool quads(const Job&) { return true; }
};

template <int ISA>
struct IntRows {  // FP4 weights only (prepare_x): isa 3 (vpdpwssd) or 1 (vpmaddwd)
    using X = int16_t;
    static const X* x_of(const Job& j, int64_t i) { return j.xi + i * j.x_stride; }
    template <int R> static bool fp8(const Job&, int64_t, const X* const*, float*) { return false; }
    template <int R> static void fp4(const Job& j, int64_t n, const X* const* xs, float* out) {
        if constexpr (ISA == 3) avx512bf16::fp4_int_rows<R>(j, &n, xs, &out);
        else avx2::fp4_int_row<R>(j, n, xs, out);
    }
    template <int R> static void bf16(const Job&, int64_t, const X* const*, float*) {}
    static bool quads(const Job& j) { return ISA == 3 && j.s_cols <= avx512bf16::QUAD_GROUPS; }
    static void quad(const Job& j, const int64_t* ns, const X* x, float* const* out) {
        if constexpr (ISA == 3) avx512bf16::fp4_int_rows<1, 4>(j, ns, &x, out);
    }
};

struct Avx2Rows {
    using X = float;
    static const X* x_of(const Job& j, int64_t i) { return j.x + i * j.x_stride; }
    static bool quads(const Job&) { return false; }
    static void quad(const Job&, const int64_t*, const X*, float* const*) {}
    template <int R> static bool fp8(const Job& j, int64_t n, const float* const* xs, float* out) {
        return avx2::fp8_row<R>(j, n, xs, out);
    }
    template <int R> static void fp4(const Job& j, int64_t n, const float* const* xs, float* out) {
        avx2::fp4_row<R>(j, n, xs, out);
    }
    template <int R> static void bf16(const Job& j, int64_t n, const float* const* xs, float* out) {
        avx2::bf16_row<R>(j, n, xs, out);
    }
};

template <class Rows, int R>
bool run_row(const Job& j, int64_t n, int64_t m0) {
    const int64_t g = j.groups == 1 ? 0 : n / (j.n / j.groups);  // no division a row where there is one group
    const typename Rows::X* xs[R];
    float out[R];
    for (int r = 0; r < R; r++) xs[r] = Rows::x_of(j, (m0 + r) * j.groups + g);
    bool nan = false;
    if (j.fmt == FMT_FP8) nan = Rows::template fp8<R>(j, n, xs, out);
    else if (j.fmt == FMT_FP4) Rows::template fp4<R>(j, n, xs, out);
    else Rows::template bf16<R>(j, n, xs, out);
    for (int r = 0; r < R; r++) j.y[(m0 + r) * j.n + n] = nan ? NAN : out[r];
    return nan;
}

// A decode's rows [n0, n1) (one row of x; rows of one group: a grouped job's units are whole groups where its groups
// are whole fp8 tiles, as DeepSeek's wo_a's) four at a time where the job takes quads: rows n0 + i + c * q of the
// unit's four quarters (q rows each) together, so that a core reads four streams of weights at once (and each step's
// x once for four rows). Out of DRAM one stream a core left the rows 1.2-1.4x a plain read of their bytes
// (AMX VM, 2 threads): four streams, 2 MB of FP8 100 -> 75-88 us, 8 MB 323 -> 267-273, 1 MB of FP4 55 -> 49
// (BENCHMARKS.md; four adjacent rows instead, their lines interleaved in one stream: slower than one row). Returns
// the first row left.
template <class Rows>
int64_t run_quads(const Job& j, int64_t n0, int64_t n1) {
    const int64_t per = j.n / j.groups, g = n0 / per;  // the rows of a group, and the group of the unit's first row
    if (j.m != 1 || (n1 - 1) / per != g || n1 - n0 < 8 || !Rows::quads(j)) return n0;
    const int64_t q = (n1 - n0) / 4;
    const typename Rows::X* x = Rows::x_of(j, g);
    for (int64_t i = n0; i < n0 + q; i++) {
        const int64_t ns[4] = {i, i + q, i + 2 * q, i + 3 * q};
        float* const out[4] = {j.y + ns[0], j.y + ns[1], j.y + ns[2], j.y + ns[3]};
        Rows::quad(j, ns, x, out);
    }
    return n0 + 4 * q;
}

template <class Rows>
bool run_rows(const Job& j, int64_t n0, int64_t n1) {
    bool nan = false;
    n0 = run_quads<Rows>(j, n0, n1);
    for (int64_t m0 = 0; m0 < j.m; m0 += MB) {
        int64_t left = j.m - m0;
        for (int64_t n = n0; n < n1; n++) {
            if (left >= 4) nan |= run_row<Rows, 4>(j, n, m0);
            else if (left == 3) nan |= run_row<Rows, 3>(j, n, m0);
            else if (left == 2) nan |= run_row<Rows, 2>(j, n, m0);
            else nan |= run_row<Rows, 1>(j, n, m0);
        }
    }
    return nan;
}

// ---------------------------------------------------------------- the mHC steps of decode rows
// One call a step instead of ~60 small torch ops (the Sinkhorn loop alone is 3 ops an iteration, each a few us on
// a [4, 4] matrix). Plain fp32 C++ (no FMA, so each product is rounded before it is added, as the torch reference
// does; the AVX2 and AVX-512 loops of the post step and the eight-lane dot products keep the same order and roundings),
// activations fp32 or bf16 (round to nearest even). The post step and the collapse
// sum in the reference's stream order and equal it bitwise; the mixes GEMV, the mean squares and the softmax sum
// in their own order (eight lanes), within rounding of mhcrun.ops.hc.

float act_at(const void* p, int bf16, int64_t i) {
    if (!bf16) return static_cast<const float*>(p)[i];
    uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

void act_put(void* p, int bf16, int64_t i, float f) {
    if (!bf16) {
        static_cast<float*>(p)[i] = f;
        return;
    }
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint16_t h = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)  // NaN stays NaN
                                                  : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    static_cast<uint16_t*>(p)[i] = h;
}

// sum of a[i] * b[i] over eight lanes, the lanes then summed in order
float dot8(const float* a, const float* b, int64_t k) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += a[i + j] * b[i + j];
    for (; i < k; i++) lane[i % 8] += a[i] * b[i];
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += lane[j];
    return s;
}

// The same sum (within rounding: another order) by sixteen lanes of FMAs, where the CPU has AVX-512.
AVX512 float dot16(const float* a, const float* b, int64_t k) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i < k; i += 16) {
        const __mmask16 m = lanes16(k - i);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

// dot8 in AVX2: the same lanes, each product rounded and then added (no FMA), the lanes summed in order: bitwise dot8.
AVX2 float dot8_avx2(const float* a, const float* b, int64_t k) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    alignas(32) float lane[8];
    _mm256_store_ps(lane, acc);
    for (; i < k; i++) lane[i % 8] += a[i] * b[i];
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += lane[j];
    return s;
}

// dot8, in AVX2 with isa >= 1.
float dot8_at(const float* a, const float* b, int64_t k, int isa) {
    return isa >= 1 ? dot8_avx2(a, b, k) : dot8(a, b, k);
}

// dot16 with isa >= 2 (AVX-512), else dot8_at.
float dot(const float* a, const float* b, int64_t k, int isa) {
    return isa >= 2 ? dot16(a, b, k) : dot8_at(a, b, k, isa);
}

float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// The post step's rows of one output stream o in fp32: out[e] = sum_i c[i * n] * res[i * d + e] + p * y[e], each
// product rounded, then added in stream order (no FMA: bitwise the scalar loop and torch's; the library is built with
// -ffp-contract=off, mhcrun.ops.native), sixteen e at a time.
AVX512 void post_stream(const float* y, const float* res, const float* c, float p, float* out, int64_t n, int64_t d) {
    int64_t e = 0;
    for (; e < d; e += 16) {
        const __mmask16 m = lanes16(d - e);
        __m512 acc = _mm512_mul_ps(_mm512_set1_ps(c[0]), _mm512_maskz_loadu_ps(m, res + e));
        for (int64_t i = 1; i < n; i++)
            acc = _mm512_add_ps(acc,
                                _mm512_mul_ps(_mm512_set1_ps(c[i * n]), _mm512_maskz_loadu_ps(m, res + i * d + e)));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(p), _mm512_maskz_loadu_ps(m, y + e)));
        _mm512_mask_storeu_ps(out + e, m, acc);
    }
}

// post_stream in AVX2, eight e at a time: the same products and sums in the same order.
AVX2 void post_stream_avx2(const float* y, const float* res, const float* c, float p, float* out, int64_t n,
                           int64_t d) {
    int64_t e = 0;
    for (; e + 8 <= d; e += 8) {
        __m256 acc = _mm256_mul_ps(_mm256_set1_ps(c[0]), _mm256_loadu_ps(res + e));
        for (int64_t i = 1; i < n; i++)
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(c[i * n]), _mm256_loadu_ps(res + i * d + e)));
        _mm256_storeu_ps(out + e, _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(p), _mm256_loadu_ps(y + e))));
    }
    for (; e < d; e++) {
        float acc = c[0] * res[e];
        for (int64_t i = 1; i < n; i++) acc += c[i * n] * res[i * d + e];
        out[e] = acc + p * y[e];
    }
}

// ---------------------------------------------------------------- the FP8 activation rounding (fp8_simulate, pow2)
// Every step is exact but the one rounding: the divisions by powers of two are multiplications by their inverses,
// exact too, so the results equal torch's bitwise (mhc_act_quant_fp8 gives the values, mhc_kv_fp8_encode the codes).

// A block's scale, the smallest power of two >= max(amax, floor) / qmax (the one division rounded as torch's; floor /
// qmax >= 2**-126: a normal power of two), and its inverse (exact; 2**-127 for the scale 2**127).
struct Pow2Scale {
    float scale, inv;
};

// The scale of a block whose largest magnitude (at least the floor) is amax.
inline Pow2Scale pow2_of(float amax, float qmax) {
    const uint32_t sb = bits_of(amax / qmax);
    const uint32_t se = (sb & 0x7FFFFF) ? (sb >> 23) + 1 : sb >> 23;  // pow2 ceil: its biased exponent
    return {float_of(se << 23), se >= 254 ? 0x1p-127f : float_of((254 - se) << 23)};
}

inline Pow2Scale pow2_scale(const float* v, int64_t len, float floor, float qmax) {
    float amax = floor;
    for (int64_t i = 0; i < len; i++) amax = std::fmax(amax, std::fabs(v[i]));
    return pow2_of(amax, qmax);
}

// The FP8 activation rounding's block scale: floor 1e-4, 448 (2**-22 <= scale < 2**121).
inline Pow2Scale fp8_scale(const float* v, int64_t len) { return pow2_scale(v, len, 1e-4f, 448.0f); }

// q = value * inv (|q| <= 448, so nothing saturates) rounded to e4m3, to nearest even: e, the biased fp32 exponent of
// |q| (|q| in [2**(e-127), 2**(e-126))), and t, |rounded q| in e4m3 steps of that binade (2**(e-130); 2**-9 below
// 2**-6), an integer <= 16.
struct E4m3Round {
    uint32_t e;
    float t;
    float step() const { return e < 121 ? 0x1p-9f : float_of((e - 3) << 23); }
};

inline E4m3Round e4m3_round(float q) {
    const float a = std::fabs(q);
    const uint32_t e = bits_of(a) >> 23;
    const float inv_step = e < 121 ? 0x1p9f : float_of((257 - e) << 23);
    return {e, (a * inv_step + 0x1p23f) - 0x1p23f};  // a * inv_step exact, <= 16; + 2**23 - 2**23: to nearest even
}

// The FP8 activation rounding of len values of one block whose scale is sc, value by value.
inline void act_quant_scalar(const float* v, float* out, int64_t len, Pow2Scale sc) {
    for (int64_t i = 0; i < len; i++) {
        const float q = v[i] * sc.inv;
        const E4m3Round rq = e4m3_round(q);
        out[i] = std::copysign(rq.t * rq.step(), q) * sc.scale;
    }
}

// One block of the FP8 activation rounding in AVX-512 (len values, the last vector masked): fp8_scale and e4m3_round
// above, lane by lane, the same operations on the same values (every product but the one rounding exact), so bitwise
// the scalar loop's; x finite.
AVX512 void act_quant_block(const float* v, float* out, int64_t len) {
    const __m512i sign = _mm512_set1_epi32(int(0x80000000u));
    __m512 am = _mm512_set1_ps(1e-4f);
    for (int64_t i = 0; i < len; i += 16)
        am = _mm512_max_ps(am, _mm512_abs_ps(_mm512_maskz_loadu_ps(avx512::tail16(len - i), v + i)));
    const Pow2Scale sc = pow2_of(_mm512_reduce_max_ps(am), 448.0f);
    const __m512 inv = _mm512_set1_ps(sc.inv), scale = _mm512_set1_ps(sc.scale), big = _mm512_set1_ps(0x1p23f);
    const __m512i e121 = _mm512_set1_epi32(121), e257 = _mm512_set1_epi32(257), e3 = _mm512_set1_epi32(3);
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 mk = avx512::tail16(len - i);
        const __m512 q = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, v + i), inv);
        const __m512 a = _mm512_abs_ps(q);
        const __m512i e = _mm512_srli_epi32(_mm512_castps_si512(a), 23);
        const __mmask16 normal = _mm512_cmpge_epu32_mask(e, e121);
        const __m512 inv_step = _mm512_mask_blend_ps(
            normal, _mm512_set1_ps(0x1p9f), _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(e257, e), 23)));
        const __m512 step = _mm512_mask_blend_ps(
            normal, _mm512_set1_ps(0x1p-9f), _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(e, e3), 23)));
        const __m512 t = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(a, inv_step), big), big);
        const __m512 r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_mul_ps(t, step)),
                                                             _mm512_and_si512(_mm512_castps_si512(q), sign)));
        _mm512_mask_storeu_ps(out + i, mk, _mm512_mul_ps(r, scale));
    }
}

AVX2 INLINE float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The same in AVX2, eight lanes; the last len % 8 values by the scalar loop (act_quant_scalar), bitwise the same.
AVX2 void act_quant_block_avx2(const float* v, float* out, int64_t len) {
    const int64_t whole = len / 8 * 8;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 am = _mm256_set1_ps(1e-4f);
    for (int64_t i = 0; i < whole; i += 8) am = _mm256_max_ps(am, _mm256_and_ps(_mm256_loadu_ps(v + i), abs_mask));
    float amax = hmax(am);
    for (int64_t i = whole; i < len; i++) amax = std::fmax(amax, std::fabs(v[i]));
    const Pow2Scale sc = pow2_of(amax, 448.0f);
    const __m256 inv = _mm256_set1_ps(sc.inv), scale = _mm256_set1_ps(sc.scale), big = _mm256_set1_ps(0x1p23f);
    const __m256i e120 = _mm256_set1_epi32(120), e257 = _mm256_set1_epi32(257), e3 = _mm256_set1_epi32(3);
    for (int64_t i = 0; i < whole; i += 8) {
        const __m256 q = _mm256_mul_ps(_mm256_loadu_ps(v + i), inv);
        const __m256 a = _mm256_and_ps(q, abs_mask);
        const __m256i e = _mm256_srli_epi32(_mm256_castps_si256(a), 23);
        const __m256 normal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(e, e120));  // e in [0, 255]: signed compare
        const __m256 inv_step = _mm256_blendv_ps(
            _mm256_set1_ps(0x1p9f), _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(e257, e), 23)), normal);
        const __m256 step = _mm256_blendv_ps(
            _mm256_set1_ps(0x1p-9f), _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(e, e3), 23)), normal);
        const __m256 t = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(a, inv_step), big), big);
        const __m256 r = _mm256_or_ps(_mm256_mul_ps(t, step), _mm256_andnot_ps(abs_mask, q));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(r, scale));
    }
    act_quant_scalar(v + whole, out + whole, len - whole, sc);
}

// Whether the values [0, n) are all finite (AVX2).
AVX2 bool all_finite_avx2(const float* x, int64_t n) {
    const __m256i exp = _mm256_set1_epi32(0x7F800000);
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_loadu_si256(
                                                          reinterpret_cast<const __m256i*>(x + i)), exp), exp));
    for (; i < n; i++)
        if (!std::isfinite(x[i])) return false;
    return _mm256_testz_si256(bad, bad);
}

// Whether the values [0, n) are all finite (AVX-512).
AVX512 bool all_finite(const float* x, int64_t n) {
    const __m512i exp = _mm512_set1_epi32(0x7F800000);
    __mmask16 bad = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __m512i u = _mm512_and_si512(_mm512_maskz_loadu_epi32(avx512::tail16(n - i), x + i), exp);
        bad |= _mm512_cmpeq_epi32_mask(u, exp);
    }
    return !bad;
}

// ---------------------------------------------------------------- attention of decode rows (mhc_attend)

namespace attend {

constexpr int HG = 8;  // heads of a query taken together: each key is read once for all of them

// The key j of a query: kv row j < n, else sel row j - n.
inline const float* key_at(const float* kv, int64_t n, const float* sel, int64_t j, int64_t d) {
    return j < n ? kv + j * d : sel + (j - n) * d;
}

// sc[hh * nk + j] = q[hh] . key j for the HN heads at q (rows of d) and the nk = n + k keys (one 8-lane FMA chain a
// head, then its lanes, then the tail).
template <int HN>
AVX2 void scores(const float* q, const float* kv, int64_t n, const float* sel, int64_t nk, int64_t d, float* sc) {
    const int64_t d8 = d / 8 * 8;
    for (int64_t j = 0; j < nk; j++) {
        const float* key = key_at(kv, n, sel, j, d);
        __m256 acc[HN];
        for (int hh = 0; hh < HN; hh++) acc[hh] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d8; i += 8) {
            const __m256 kc = _mm256_loadu_ps(key + i);
            for (int hh = 0; hh < HN; hh++) acc[hh] = _mm256_fmadd_ps(_mm256_loadu_ps(q + hh * d + i), kc, acc[hh]);
        }
        for (int hh = 0; hh < HN; hh++) {
            float t = avx2::hsum(acc[hh]);
            for (int64_t i = d8; i < d; i++) t += q[hh * d + i] * key[i];
            sc[hh * nk + j] = t;
        }
    }
}

// o[hh] = sum over the nk keys of p[hh * nk + j] * key j, for HN heads (o rows of d).
template <int HN>
AVX2 void weighted(const float* p, const float* kv, int64_t n, const float* sel, int64_t nk, int64_t d, float* o) {
    const int64_t d8 = d / 8 * 8;
    for (int64_t i = 0; i < d8; i += 8) {
        __m256 acc[HN];
        for (int hh = 0; hh < HN; hh++) acc[hh] = _mm256_setzero_ps();
        for (int64_t j = 0; j < nk; j++) {
            const __m256 kc = _mm256_loadu_ps(key_at(kv, n, sel, j, d) + i);
            for (int hh = 0; hh < HN; hh++) acc[hh] = _mm256_fmadd_ps(_mm256_set1_ps(p[hh * nk + j]), kc, acc[hh]);
        }
        for (int hh = 0; hh < HN; hh++) _mm256_storeu_ps(o + hh * d + i, acc[hh]);
    }
    for (int64_t i = d8; i < d; i++)
        for (int hh = 0; hh < HN; hh++) {
            float t = 0.0f;
            for (int64_t j = 0; j < nk; j++) t += p[hh * nk + j] * key_at(kv, n, sel, j, d)[i];
            o[hh * d + i] = t;
        }
}

// The larger of m and v, NaN once either is NaN (as torch's amax).
inline float nan_max(float m, float v) { return (v > m || v != v) ? v : m; }

// One head's scores sc[nk] (valid: mask[j] for j < n, smask[j - n] after) -> its probabilities in place: softmax over
// the valid keys (the others 0), the sink adding exp(sink - max) to the denominator only.
inline void softmax(float* sc, const uint8_t* mask, int64_t n, const uint8_t* smask, int64_t nk, float sink,
                    float scale) {
    float m = -INFINITY;
    for (int64_t j = 0; j < nk; j++) {
        const bool valid = j < n ? mask[j] : smask[j - n];
        m = nan_max(m, sc[j] = valid ? sc[j] * scale : -INFINITY);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < nk; j++) sum += (sc[j] = std::exp(sc[j] - m));  // masked keys: exp(-inf) = 0
    const float denom = sum + std::exp(sink - m);
    for (int64_t j = 0; j < nk; j++) sc[j] /= denom;
}

// scores<HN> with AVX-512 (the same sums in another order): two keys at a time, each of the heads' q chunks loaded
// once for both (the loads no longer outnumber the FMAs), sixteen lanes, the tail of d under a mask.
template <int HN>
AVX512 void scores16(const float* q, const float* kv, int64_t n, const float* sel, int64_t nk, int64_t d, float* sc) {
    const __mmask16 tail = lanes16(d % 16);
    const int64_t d16 = d / 16 * 16;
    int64_t j = 0;
    for (; j < nk; j += 2) {
        const bool pair = j + 1 < nk;
        const float* k0 = key_at(kv, n, sel, j, d);
        const float* k1 = pair ? key_at(kv, n, sel, j + 1, d) : k0;
        __m512 a0[HN], a1[HN];
        for (int hh = 0; hh < HN; hh++) a0[hh] = a1[hh] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d16; i += 16) {
            const __m512 c0 = _mm512_loadu_ps(k0 + i), c1 = _mm512_loadu_ps(k1 + i);
            for (int hh = 0; hh < HN; hh++) {
                const __m512 qv = _mm512_loadu_ps(q + hh * d + i);
                a0[hh] = _mm512_fmadd_ps(qv, c0, a0[hh]);
                a1[hh] = _mm512_fmadd_ps(qv, c1, a1[hh]);
            }
        }
        if (tail) {
            const __m512 c0 = _mm512_maskz_loadu_ps(tail, k0 + d16), c1 = _mm512_maskz_loadu_ps(tail, k1 + d16);
            for (int hh = 0; hh < HN; hh++) {
                const __m512 qv = _mm512_maskz_loadu_ps(tail, q + hh * d + d16);
                a0[hh] = _mm512_fmadd_ps(qv, c0, a0[hh]);
                a1[hh] = _mm512_fmadd_ps(qv, c1, a1[hh]);
            }
        }
        for (int hh = 0; hh < HN; hh++) {
            sc[hh * nk + j] = _mm512_reduce_add_ps(a0[hh]);
            if (pair) sc[hh * nk + j + 1] = _mm512_reduce_add_ps(a1[hh]);
        }
    }
}

// weighted<HN> with AVX-512 (the same sums in another order): 32 channels at a time, each key's chunk loaded once for
// all the heads, the tail of d under masks.
template <int HN>
AVX512 void weighted16(const float* p, const float* kv, int64_t n, const float* sel, int64_t nk, int64_t d, float* o) {
    for (int64_t i = 0; i < d; i += 32) {
        const __mmask16 m0 = lanes16(d - i), m1 = lanes16(d - i - 16 > 0 ? d - i - 16 : 0);
        __m512 a0[HN], a1[HN];
        for (int hh = 0; hh < HN; hh++) a0[hh] = a1[hh] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nk; j++) {
            const float* key = key_at(kv, n, sel, j, d) + i;
            const __m512 c0 = _mm512_maskz_loadu_ps(m0, key), c1 = _mm512_maskz_loadu_ps(m1, key + 16);
            for (int hh = 0; hh < HN; hh++) {
                const __m512 pb = _mm512_set1_ps(p[hh * nk + j]);
                a0[hh] = _mm512_fmadd_ps(pb, c0, a0[hh]);
                a1[hh] = _mm512_fmadd_ps(pb, c1, a1[hh]);
            }
        }
        for (int hh = 0; hh < HN; hh++) {
            _mm512_mask_storeu_ps(o + hh * d + i, m0, a0[hh]);
            _mm512_mask_storeu_ps(o + hh * d + i + 16, m1, a1[hh]);
        }
    }
}

template <int HN>
void heads(bool wide, const float* q, const float* kv, const uint8_t* mask, int64_t n, const float* sel,
           const uint8_t* smask, int64_t nk, const float* sink, float scale, int64_t d, float* sc, float* o) {
    if (wide)
        scores16<HN>(q, kv, n, sel, nk, d, sc);
    else
        scores<HN>(q, kv, n, sel, nk, d, sc);
    for (int hh = 0; hh < HN; hh++) softmax(sc + hh * nk, mask, n, smask, nk, sink[hh], scale);
    if (wide)  // masked keys too: 0 * a NaN key is NaN, as in the reference
        weighted16<HN>(sc, kv, n, sel, nk, d, o);
    else
        weighted<HN>(sc, kv, n, sel, nk, d, o);
}

// Heads [h0, h0 + hn) (hn <= HG) of one query: q, o at head h0, sink at h0; `wide`: AVX-512 (else AVX2).
inline void head_group(bool wide, int hn, const float* q, const float* kv, const uint8_t* mask, int64_t n,
                       const float* sel, const uint8_t* smask, int64_t nk, const float* sink, float scale, int64_t d,
                       float* sc, float* o) {
    switch (hn) {
        case 8: heads<8>(wide, q, kv, mask, n, sel, smask, nk, sink, scale, d, sc, o); break;
        case 7: heads<7>(wide, q, kv, mask, n, sel, smask, nk, sink, scale, d, sc, o); break;
        case 6: heads<6>(wide, q, kv, mask, n, sel, smask, nk, sink, scale, d, sc, o); break;
        case 5: heads<5>(wide, q, kv, mask, n, sel, smask, nk, sink, scale, d, sc, o); break;
        case 4: heads<4>(wide, q, kv, mask, n, sel, smask, nk, sink, scale, d, sc, o); break;
        case 3: heads<3>(wide, q, kv, mask, n, sel, smask, nk, sink, scale, d, sc, o); break;
        case 2: heads<2>(wide, q, kv, mask, n, sel, smask, nk, sink, scale, d, sc, o); break;
        default: heads<1>(wide, q, kv, mask, n, sel, smask, nk, sink, scale, d, sc, o); break;
    }
}

}  // namespace attend

// ---------------------------------------------------------------- GEMV jobs: one weight and its rows of x

// 3 the instruction set asked for is not this CPU's; 6 fp4 on AVX2 with a block that is not a multiple of 32.
int check_args(int fmt, int64_t block, int isa) {
    if (isa < 1 || isa > mhc_qgemv_isa()) return 3;
    if (fmt == FMT_FP4 && isa == 1 && block % 32 != 0) return 6;
    return 0;
}

Job make_job(int fmt, int scale_kind, const void* w, const void* s, const float* x, float* y, int64_t m, int64_t n,
             int64_t k, int64_t block, int64_t groups) {
    Job j{fmt, scale_kind, static_cast<const uint8_t*>(w), s, x, y, m, n, k, block, groups,
          fmt == FMT_FP4 ? k / 2 : fmt == FMT_FP8 ? k : 2 * k, 0, k};
    if (fmt == FMT_FP8 || fmt == FMT_FP4) j.s_cols = (k + block - 1) / block;
    return j;
}


// The x a job's rows read, made by prepare_x.
struct XBuf {
    std::vector<float> f;
    std::vector<uint16_t> h;
    IntX i;
    Floats g;  // the rows gathered, where they were given by a row map and the integer x does not take them
    std::vector<uint32_t> p;  // x in bf16 pairs for the panels (j.xp)
};

// x rows [rows, k] -> xs [rows, 2 * half] (half >= ceil(k / 2)): each row's even inputs, then its odd ones, each half
// zero-padded past its values. The split x of AVX2's bf16 rows (half: avx2::split_half) and of AVX-512's bf16 and fp4
// rows (k even, half k / 2; k a multiple of 32 by AVX-512's split_x with isa 2 or 3).
void split_x(const float* x, float* xs, int64_t rows, int64_t k, int64_t half, int isa) {
    if (isa >= 2 && 2 * half == k && k % 32 == 0) return avx512::split_x(x, xs, rows, k);
    std::fill(xs, xs + rows * 2 * half, 0.0f);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) xs[r * 2 * half + (i & 1) * half + i / 2] = x[r * k + i];
}

// Whether AVX2's panels take an FP4 weight's rows (given PANEL_MIN_ROWS rows of x or more and one group of outputs):
// e8m0 scales, one a group of 32 inputs, `s_cols` a row; whole chunks of inputs. qgemv.py's routed_routes asks it
// through mhc_panels_take.
inline bool panel_layout(int fmt, int scale_kind, int64_t block, int64_t k, int64_t s_cols, int isa) {
    return isa == 1 && fmt == FMT_FP4 && block == 32 && scale_kind == 0 && k % INT_CHUNK == 0 && s_cols == k / 32;
}

// Whether the BF16 panels take a GEMV job's many rows (gemm::JOB_ROWS_*, mhc_panels_take): on CPUs without AMX (the
// rates there measured on Zen 4, whose vdpbf16ps retires one a cycle); where AMX is, its GEMMs take a long chunk's
// experts (CpuKernel.gemm_first) and the Intel cores' vdpbf16ps retires one every 2 cycles, so the GEMV rows stay.
inline bool job_panels() { return !amx::usable(); }

// With isa 3: x's rows (row r at j.x + from[r] * k with a row map, else j.x + r * k) as bf16 pairs in `own` for the
// panels (j.xp, k2 pairs a row), where every value and the job's scales qualify (gemm::pack_row, gemm::scales_take:
// then the panels are exact up to the order of the sums); false, j untouched, where they do not.
bool pack_pairs(Job& j, XBuf& own, const int64_t* from) {
    const int64_t k = j.k, k2 = (k + 1) / 2;
    if (!gemm::scales_take(j)) return false;
    own.p.resize(j.m * k2);
    for (int64_t r = 0; r < j.m; r++)
        if (!gemm::pack_row(j.x + (from ? from[r] : r) * k, k, k2, own.p.data() + r * k2, 16)) return false;
    j.xp = own.p.data();
    return true;
}

// Points the job at the x its rows read, made in `own`: with isa 3 and gemm::JOB_ROWS_FP4 / _FP8 rows or more whose
// values and scales qualify, x in bf16 pairs for the panels (pack_pairs: j.xp); with isa 3 or 1 (AVX2), fp4 whose x
// the integer rows take (make_int_x), x as integer windows in their order (j.xi; with AVX2, PANEL_MIN_ROWS rows or
// more of e8m0 groups of 32 and whole chunks: in input order, split at each chunk's top bits, for the panels:
// j.panel); else with isa 3, fp8 / fp4 whose x qualifies (avx512bf16::takes_bf16) and whose tiles / groups the
// dot-product rows take, x in bf16 in their order (j.xb); else for fp4 and bf16 weights (AVX-512: of an even number
// of inputs, avx512::bf16_split), x reordered (AVX-512: each row's even inputs, then its odd ones; AVX2:
// fp4_permute's order, bf16's split_x); else x as given.
// With `from`, row r of x lies at j.x + from[r] * k (a routed expert's rows): the integer x and the pairs read them
// there, the others a gathered copy. False when out of memory.
bool prepare_x(Job& j, int isa, XBuf& own, const int64_t* from = nullptr) {
    const int64_t rows = j.m * j.groups, k = j.k;
    const bool fits = (j.fmt == FMT_FP8 && j.block % 64 == 0) ||
                      (j.fmt == FMT_FP4 && j.block == 32 && j.s_cols <= avx512bf16::ROW_GROUPS);
    try {
        if (isa == 3 && job_panels() && j.m >= (j.fmt == FMT_FP4 ? gemm::JOB_ROWS_FP4 : gemm::JOB_ROWS_FP8) &&
            j.groups == 1 && (j.fmt == FMT_FP8 || j.fmt == FMT_FP4) && j.block % 32 == 0 && pack_pairs(j, own, from))
            return true;
        const bool int_rows = (isa == 3 && fits) || isa == 1;  // isa 1: block % 32 == 0 (check_args)
        const bool panel = panel_layout(j.fmt, j.scale_kind, j.block, k, j.s_cols, isa) && j.groups == 1 &&
                           j.m >= avx2::PANEL_MIN_ROWS;
        if (j.fmt == FMT_FP4 && int_rows &&
            make_int_x(j.x, rows, k, panel ? in_order : isa == 3 ? avx512bf16::fp4_slot : avx2::fp4_int_slot,
                       panel || isa == 3 ? 0 : avx2::FP4_INT_UNIT, own.i, panel, from, isa)) {
            j.panel = panel;
            j.x_stride = own.i.chunks * 2 * INT_CHUNK;
            j.xi = own.i.v.data(), j.xi_scale = own.i.scale.data(), j.xi_two = own.i.two.data();
            j.xi_any_two = own.i.any_two.data();
            return true;
        }
        if (from) {
            own.g.resize(rows * k);
            for (int64_t r = 0; r < rows; r++) std::memcpy(own.g.data() + r * k, j.x + from[r] * k, sizeof(float) * k);
            j.x = own.g.data();
        }
        if (isa == 3 && fits && avx512bf16::takes_bf16(j.x, rows * k)) {
            const int64_t width = j.fmt == FMT_FP4 ? 128 : 64;
            j.x_stride = (k + width - 1) / width * width;
            own.h.resize(rows * j.x_stride);
            if (j.fmt == FMT_FP8) avx512bf16::permute_fp8_x(j.x, own.h.data(), rows, k, j.x_stride);
            else avx512bf16::permute_x(j.x, own.h.data(), rows, k, j.x_stride, int(width), avx512bf16::fp4_slot);
            j.xb = own.h.data();
            return true;
        }
        if (isa == 3 && j.fmt == FMT_FP8 && j.block % 64 == 0) {  // x not exact in bf16 (above)
            j.x_stride = (k + 63) / 64 * 64;
            own.f.resize(rows * j.x_stride);
            avx512bf16::permute_x(j.x, own.f.data(), rows, k, j.x_stride, 64, avx512bf16::fp8_f32_slot);
            j.x = own.f.data(), j.f32_fp8 = true;
            return true;
        }
        if (isa == 1 && j.fmt == FMT_FP8) {
            own.f.resize(rows * k);
            j.x_exp = avx2::scale_x(j.x, own.f.data(), rows, k);
            j.x = own.f.data();
            return true;
        }
        const bool split = isa >= 2 || j.fmt == FMT_BF16;  // else AVX2's fp4 rows: fp4_permute
        if (j.fmt != FMT_FP4 && !(isa >= 2 && avx512::bf16_split(j)) && !(isa == 1 && j.fmt == FMT_BF16)) return true;
        j.x_stride = isa >= 2 ? k : split ? 2 * avx2::split_half(k) : (k + 63) / 64 * 64;
        own.f.resize(rows * j.x_stride);
        if (split) split_x(j.x, own.f.data(), rows, k, j.x_stride / 2, isa);
        else avx2::fp4_permute(j.x, own.f.data(), rows, k, j.x_stride);
    } catch (const std::bad_alloc&) {
        return false;
    }
    j.x = own.f.data();
    return true;
}

// ---------------------------------------------------------------- a decode step in one parallel region
// A decode step's GEMVs are separated by serial work on the calling thread (Python, the graphs' own code, small
// kernels: ~4-6 ms of an ~18-23 ms step of the mid-size config on a 2-core CPU) while OpenMP's other threads wait and
// the memory idles. mhc_run_step runs a step (a callback) on the calling thread inside one parallel region whose other
// threads (workers) join the step's parallel loops (`for_each_index`: run_jobs's units, the mHC mixes, the routing
// logits, the decode attention, the indexer's entries) and, between them, the first worker reads the first READ_AHEAD
// bytes of the weights the next call will read (a GEMV's, or a site's mHC mixes or the router's: note_read): those
// the call read that followed this call's weight at the previous step
// (BENCHMARKS.md: 55-100 MB a step so, in the gaps, on 2 threads). A loop's index computes the same wherever it runs
// and reads ahead change no value. The calling thread waits only for workers inside its loop: an absent (descheduled)
// worker costs speed, never a hang. Workers spin while a step runs, as OpenMP's do between its regions (a run whose
// OpenMP threads sleep, OMP_WAIT_POLICY=passive, runs no step so: mhcrun.ops.qgemv.StepScope).
constexpr int64_t READ_AHEAD = 4 << 20;
constexpr int64_t READ_PIECE = 4096;  // read ahead between two looks for a loop
constexpr int MAX_RANGES = 32;

struct Ranges {  // the weights a call read: a GEMV's jobs' rows, or what note_read was given
    int n = 0;
    const uint8_t* at[MAX_RANGES];
    int64_t bytes[MAX_RANGES];
};

// A parallel loop of the calling thread: body(i) for i in [0, count). The indexes still to run are [front, back): the
// workers take them from the front, the calling thread from the back, so that a worker runs the first indexes, whose
// weights it read ahead into its own caches, and the calling thread those it has to fetch itself.
struct Loop {
    const std::function<int(int64_t)>* body;
    std::atomic<uint64_t> span;  // front << 32 | back
    std::atomic<int> flags{0};   // the OR of body's results
    Loop(int64_t count, const std::function<int(int64_t)>* b) : body(b), span(uint64_t(count)) {}
};

struct StepScope {
    std::atomic<Loop*> loop{nullptr};  // the loop running, null between loops
    std::atomic<int> inside{0};        // workers inside `loop` (or about to look at it)
    std::atomic<bool> stop{false};
    std::atomic<int64_t> version{0};   // of `plan`: odd while the calling thread writes it (a sequence lock)
    Ranges plan[2];                    // what to read ahead: plan[(version / 2) % 2]
    std::atomic<int64_t> read{0};      // bytes read ahead, in all
    std::unordered_map<const void*, Ranges> next_of;  // a call's first weight -> what the call after it read
    const void* last = nullptr;        // the last call's first weight
};

thread_local StepScope* step_scope = nullptr;  // the calling thread's, while mhc_run_step runs its step with workers

// The loop's indexes from the front (a worker) or from the back (the calling thread), one at a time, until none is left.
void run_indexes(Loop& loop, bool back) {
    int f = 0;
    for (uint64_t s = loop.span.load(std::memory_order_relaxed);;) {
        const uint64_t front = s >> 32, end = s & 0xFFFFFFFFu;
        if (front >= end) break;
        if (!loop.span.compare_exchange_weak(s, back ? s - 1 : s + (uint64_t(1) << 32), std::memory_order_relaxed))
            continue;  // s holds the span as it is now
        f |= (*loop.body)(int64_t(back ? end - 1 : front));
        s = loop.span.load(std::memory_order_relaxed);
    }
    if (f) loop.flags.fetch_or(f, std::memory_order_relaxed);
}

// A worker of a step: the loops posted, and (`ahead`) the planned reads between them.
void serve(StepScope& sc, bool ahead) {
    int64_t version = -1, at = 0, left = 0;
    int range = 0;
    Ranges r;
    uint64_t sink = 0;
    while (!sc.stop.load(std::memory_order_acquire)) {
        if (sc.loop.load(std::memory_order_relaxed) != nullptr) {
            sc.inside.fetch_add(1);  // then look (seq_cst, as the caller's clearing and its look at `inside`)
            if (Loop* loop = sc.loop.load()) run_indexes(*loop, false);
            sc.inside.fetch_sub(1);
            continue;
        }
        if (ahead) {
            if (const int64_t v = sc.version.load(std::memory_order_acquire); v != version && !(v & 1)) {
                const Ranges copy = sc.plan[(v >> 1) & 1];
                if (sc.version.load(std::memory_order_acquire) == v)
                    r = copy, version = v, range = 0, at = 0, left = READ_AHEAD;
            }
            if (range < r.n && left > 0) {
                const int64_t n = std::min(READ_PIECE, r.bytes[range] - at);
                for (int64_t i = 0; i + 8 <= n; i += 64)  // a word a line, none past the weight's end
                    sink += *reinterpret_cast<const volatile uint64_t*>(r.at[range] + at + i);
                sc.read.fetch_add(n, std::memory_order_relaxed);
                at += n, left -= n;
                if (at >= r.bytes[range]) range++, at = 0;
                continue;
            }
        }
        _mm_pause();
    }
    static_cast<void>(*reinterpret_cast<volatile uint64_t*>(&sink));
}

// body(i) for i in [0, count) by the calling thread and the workers that join -> the OR of the results.
int run_posted(StepScope& sc, int64_t count, const std::function<int(int64_t)>& body) {
    Loop loop(count, &body);
    sc.loop.store(&loop);
    run_indexes(loop, true);
    sc.loop.store(nullptr);
    while (sc.inside.load() != 0) _mm_pause();  // a worker that saw the loop is done with it
    return loop.flags.load(std::memory_order_relaxed);
}

// f(i) for i in [0, count) on `threads` threads: those of the calling thread's step where it runs one
// (mhc_run_step), else OpenMP's -> the OR of f's results. f must not depend on the thread that runs it.
template <class F>
int for_each_index(int64_t count, int threads, F f) {
    int flags = 0;
    if (threads <= 1 || count <= 1) {
        for (int64_t i = 0; i < count; i++) flags |= f(i);
        return flags;
    }
    if (step_scope != nullptr && count <= int64_t(UINT32_MAX))  // a Loop's span holds 32-bit indexes
        return run_posted(*step_scope, count, std::function<int(int64_t)>(f));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : flags)
    for (int64_t i = 0; i < count; i++) flags |= f(i);
    return flags;
}

// The (query row, head group) tasks of `rows` queries of h heads on `threads` threads (`for_each_index`), each
// call(row, h0, hn, sc) (heads [h0, h0 + hn); sc: the running thread's scratch for HG * nk scores, kept from call to
// call; it returns 0, or 2 where it could not have scratch of its own) where the thread takes the calling thread's
// subnormal mode (`caller`) and that mode does not flush -> the OR of 1 where it flushes (no task ran) and 2 where a
// scratch could not be had.
template <class F>
int head_group_tasks(int64_t rows, int64_t h, int64_t nk, unsigned caller, int threads, F call) {
    const int64_t groups = (h + attend::HG - 1) / attend::HG;
    return for_each_index(rows * groups, threads, [&](int64_t t) {
        if (take_caller_mode(caller)) return 1;
        thread_local std::vector<float> sc;
        try {
            if (static_cast<int64_t>(sc.size()) < attend::HG * nk) sc.resize(attend::HG * nk);
        } catch (const std::bad_alloc&) {
            return 2;
        }
        const int64_t row = t / groups, h0 = t % groups * attend::HG;
        return call(row, h0, h - h0 < attend::HG ? int(h - h0) : attend::HG, sc.data());
    });
}

// After a call of a step that read weights `mine` (a GEMV's jobs, or note_read's): they are what follows the call
// before it; what followed this call last time is read ahead now.
void plan_next(StepScope& sc, const Ranges& mine) {
    if (sc.last != nullptr) sc.next_of[sc.last] = mine;
    sc.last = mine.at[0];
    const auto it = sc.next_of.find(sc.last);
    if (it == sc.next_of.end()) return;
    const int64_t v = sc.version.load(std::memory_order_relaxed);
    sc.version.store(v + 1, std::memory_order_release);
    sc.plan[((v >> 1) + 1) & 1] = it->second;
    sc.version.store(v + 2, std::memory_order_release);
}

// A step's call that read the bytes [p, p + n) of weights that stay from step to step apart from the GEMVs (a site's
// mHC mixes, the router's logits), outside a step's region nothing: noted as a GEMV call's weights are, so that at the
// next step the gap before the call reads them ahead (a mixes' 786 KB then took ~18 us a site where it took ~42: the
// 2-core AMX VM, BENCHMARKS.md). As a GEMV's weights, the bytes must outlive the scope: the callers hand the model's
// own tensors over (CpuKernel.hc_post_pre's fn, CpuKernel.route's weight, and their C++ ops': fp32 and contiguous as
// loaded, so `.contiguous()` copies nothing).
void note_read(const void* p, int64_t n) {
    if (step_scope == nullptr || n <= 0) return;
    Ranges mine;
    mine.n = 1, mine.at[0] = static_cast<const uint8_t*>(p), mine.bytes[0] = n;
    plan_next(*step_scope, mine);
}

// Every job's rows, in one parallel region: units of contiguous rows (about UNIT_BYTES of weights, but at least
// UNITS_A_THREAD units a thread a job; fp8 whole tiles when a job has enough of them) go to whichever thread is free,
// so that a thread slowed by the machine (two vCPUs sharing a core, a neighbour) does not hold the other at the join.
// A row's result does not depend on its unit or thread. 0, or 5 when a thread flushes subnormals. Each unit starts its
// stream of misses afresh: over 1 GB of bf16 rows on 2 MB pages, 2 threads read 26.7-27.4 GB/s in units of 128 KB and
// 29.4-29.9 in units of 2 MB (AMX VM); a decode step's matrices but the head are small enough that the units a thread
// decide: two rather than four made an eager decode step of the mid-size config 0.97-0.98x the time, a regions step
// ~0.97x, the routed call 0.97-0.98x; one, no faster than two (BENCHMARKS.md).
constexpr int64_t UNIT_BYTES = 2 << 20, UNITS_A_THREAD = 2;

int run_jobs(const std::vector<Job>& jobs, int isa, int threads) {
    struct Unit {
        size_t job;
        int64_t n0, n1;
    };
    std::vector<Unit> units;
    for (size_t i = 0; i < jobs.size(); i++) {
        const Job& j = jobs[i];
        const int64_t most = std::max<int64_t>(1, j.n / (UNITS_A_THREAD * threads));
        const int64_t rows = UNIT_BYTES / std::max<int64_t>(1, j.row_bytes);
        const int64_t sized = std::clamp<int64_t>(rows, 1, most);  // ~UNIT_BYTES, but UNITS_A_THREAD units a thread
        const int64_t unit = j.fmt == FMT_FP8 && j.n >= j.block * threads ? std::max(j.block, sized / j.block * j.block)
                                                                           : sized;
        for (int64_t n0 = 0; n0 < j.n; n0 += unit) units.push_back({i, n0, n0 + unit < j.n ? n0 + unit : j.n});
    }
    const unsigned caller = _mm_getcsr();
    const int flush = for_each_index(static_cast<int64_t>(units.size()), threads, [&](int64_t u) {
        const Unit& t = units[u];
        const int flushes = take_caller_mode(caller);
        const Job& j = jobs[t.job];
        if (j.xp) {
            if (!gemm::run_job(j, t.n0, t.n1)) return flushes | 2;
        } else if (j.panel) {
            avx2::run_panels(j, t.n0, t.n1);
        } else {  // NaN rows are written as NaN (run_row)
            j.xi ? (isa == 3 ? run_rows<IntRows<3>>(j, t.n0, t.n1) : run_rows<IntRows<1>>(j, t.n0, t.n1))
            : j.xb ? run_rows<Bf16Rows>(j, t.n0, t.n1)
            : j.f32_fp8 ? run_rows<F32Fp8Rows>(j, t.n0, t.n1)
            : isa >= 2 ? run_rows<Avx512Rows>(j, t.n0, t.n1) : run_rows<Avx2Rows>(j, t.n0, t.n1);
        }
        return flushes;
    });
    if (step_scope != nullptr && !jobs.empty()) {
        Ranges mine;
        for (const Job& j : jobs)
            if (mine.n < MAX_RANGES) mine.at[mine.n] = j.w, mine.bytes[mine.n++] = j.n * j.row_bytes;
        plan_next(*step_scope, mine);
    }
    return flush & 2 ? 4 : flush ? 5 : 0;
}

}  // namespace

// One entry v [nope + rd] of the kv cache's fp8 format (pow2 scales) -> its e4m3 codes [nope], block scales
// [ceil(nope / block)] and rope channels [rd], bitwise kvcache.encode (mhc_kv_fp8_encode says how). v finite.
void encode_fp8_entry(const float* v, uint8_t* codes, float* scales, float* rope, int64_t nope, int64_t block,
                      int64_t rd) {
    for (int64_t k0 = 0, g = 0; k0 < nope; k0 += block, g++) {
        const int64_t len = k0 + block < nope ? block : nope - k0;
        const Pow2Scale sc = fp8_scale(v + k0, len);
        scales[g] = sc.scale;
        for (int64_t i = 0; i < len; i++) {
            const float q = v[k0 + i] * sc.inv;
            const E4m3Round rq = e4m3_round(q);
            const uint32_t e = rq.e, t = uint32_t(rq.t);
            // e4m3: below 2**-6 (e < 121) t is the code (a subnormal mantissa, or 8: the smallest normal, 2**-6);
            // else t in [8, 16] steps of 2**(e-130): exponent field e - 120 and mantissa t - 8, 16 the next one's 8
            const uint32_t code = e < 121 ? t : t == 16 ? (e - 119) << 3 : ((e - 120) << 3) | (t - 8);
            codes[k0 + i] = uint8_t(code | (std::signbit(q) ? 0x80 : 0));
        }
    }
    std::memcpy(rope, v + nope, sizeof(float) * rd);
}

// A compressor's token into its state slot: kv as it is, the score plus its positional bias (one rounding, as torch's
// add).
void put_token(float* kv_slot, float* score_slot, const float* kv, const float* score, const float* bias, int64_t c) {
    std::memcpy(kv_slot, kv, sizeof(float) * c);
    for (int64_t e = 0; e < c; e++) score_slot[e] = score[e] + bias[e];
}

// One entry of the fp4 format (indexer keys: packed codes [k / 2], scales [ceil(k / block)]) -> dst [k] fp32, bitwise
// kvcache.decode (decode_block).
void decode_fp4_entry(const uint8_t* packed, const float* scales, float* dst, int64_t k, int64_t block, int isa) {
    for (int64_t c0 = 0, g = 0; c0 < k; c0 += block, g++)
        decode_block(FMT_FP4, isa, packed, dst, c0, c0 + block < k ? c0 + block : k, scales[g]);
}

// One entry of the kv cache's fp8 format (codes [nope], scales, rope [rd]) -> dst [nope + rd] fp32, bitwise
// kvcache.decode (decode_block).
void decode_fp8_entry(const uint8_t* codes, const float* scales, const float* rope, float* dst, int64_t nope,
                      int64_t block, int64_t rd, int isa) {
    for (int64_t c0 = 0, g = 0; c0 < nope; c0 += block, g++)
        decode_block(FMT_FP8, isa, codes, dst, c0, c0 + block < nope ? c0 + block : nope, scales[g]);
    std::memcpy(dst + nope, rope, sizeof(float) * rd);
}

extern "C" {

// The post step of t rows: out[r, o, :] = sum_i comb[r, i, o] * res[r, i, :] + post[r, o] * y[r, :] (mhcrun.ops.hc
// .hc_post: stream order, then the post term; fp32, stored in the activations' dtype). y [t, d], res and out
// [t, n, d] (bf16 or fp32), post [t, n], comb [t, n, n] fp32. fp32 with isa >= 2: sixteen values a step (post_stream).
// A prefill's many rows split over `threads` threads (each row's values as on one: 1,024 rows of the mid-size config
// 5 ms on one thread, where torch's 2n + 1 passes take 42).
int mhc_hc_post(int bf16, const void* y, const void* res, const float* post, const float* comb, void* out,
                int64_t t, int64_t n, int64_t d, int isa, int threads) {
    if (isa < 0 || isa > mhc_qgemv_isa()) return 3;
    if (flushes_denormals()) return 5;
    const unsigned caller = _mm_getcsr();
#pragma omp parallel for schedule(static) num_threads(threads) if (t * n * d >= PARALLEL_VALUES)
    for (int64_t r = 0; r < t; r++) {
        take_caller_mode(caller);  // the caller does not flush (above)
        for (int64_t o = 0; o < n; o++) {
            const float* c = comb + (r * n) * n + o;  // c[i * n]: comb[r, i, o]
            const float p = post[r * n + o];
            if (!bf16 && isa >= 1) {
                (isa >= 2 ? post_stream : post_stream_avx2)(static_cast<const float*>(y) + r * d,
                                                            static_cast<const float*>(res) + r * n * d, c, p,
                                                            static_cast<float*>(out) + (r * n + o) * d, n, d);
                continue;
            }
            for (int64_t e = 0; e < d; e++) {
                float acc = c[0] * act_at(res, bf16, (r * n) * d + e);
                for (int64_t i = 1; i < n; i++) acc += c[i * n] * act_at(res, bf16, (r * n + i) * d + e);
                acc += p * act_at(y, bf16, r * d + e);
                act_put(out, bf16, (r * n + o) * d + e, acc);
            }
        }
    }
    return 0;
}

// The pre step of a site and its sublayer's RMSNorm for t rows (mhcrun.nki.ops.hc_pre's reference): x [t, n, d]
// (bf16 or fp32), fn [(2 + n) * n, n * d], scale [3], base [(2 + n) * n], weight [d] fp32 -> h [t, d] (x's dtype),
// post [t, n], comb [t, n, n] fp32. mixes = (x . fn^T) * rsqrt(mean(x^2) + norm_eps); pre = sigmoid(. * scale0 +
// base) + eps, post = 2 sigmoid(.), comb = Sinkhorn of (. * scale2 + base) (softmax over each row, + eps, then
// column, row, ..., column: `iters` column steps); h = rms_norm(collapse(x, pre) in x's dtype, weight).
// With post null (comb, weight unused), V4's head collapse (mhcrun.ops.hc.hc_head): fn [n, n * d], scale [1], base
// [n]; h = collapse(x, pre) in x's dtype, no norm.
// work: fp32 scratch of n * d + (2 + n) * n floats (null: the call makes its own). The mixes' dot products (fn: (2 +
// n) * n rows of n * d) are shared among `threads` threads, by sixteen lanes of FMAs with isa >= 2 (AVX-512), else
// eight lanes (dot8; in AVX2 with isa 1). Returns
// 6 for n > 64, 3 for an isa this CPU lacks, 4 out of memory.
int mhc_hc_pre(int bf16, const void* x, const float* fn, const float* scale, const float* base,
               const float* weight, void* h, float* post, float* comb, int64_t t, int64_t n, int64_t d,
               int64_t iters, float eps, float norm_eps, float* work, int isa, int threads) {
    if (isa < 0 || isa > mhc_qgemv_isa()) return 3;
    if (flushes_denormals()) return 5;
    if (n > 64) return 6;
    const int64_t k = n * d, mix = post ? (2 + n) * n : n;  // the head: its pre weights only
    const unsigned caller = _mm_getcsr();
    std::vector<float> own;
    if (!work) {
        try {
            own.resize(k + mix);
        } catch (const std::bad_alloc&) {
            return 4;
        }
        work = own.data();
    }
    float* xf = work;
    float* m = work + k;
    for (int64_t r = 0; r < t; r++) {
        for (int64_t i = 0; i < k; i++) xf[i] = act_at(x, bf16, r * k + i);
        const float ms = dot(xf, xf, k, isa) / static_cast<float>(k);
        const float rs = 1.0f / std::sqrt(ms + norm_eps);
        for_each_index(mix, threads, [&](int64_t j) {
            take_caller_mode(caller);  // the caller does not flush (above)
            m[j] = dot(xf, fn + j * k, k, isa) * rs;
            return 0;
        });
        float pre[64];
        for (int64_t i = 0; i < n; i++) pre[i] = sigmoid(m[i] * scale[0] + base[i]) + eps;
        if (!post) {  // the head: the collapse alone
            for (int64_t e = 0; e < d; e++) {
                float acc = pre[0] * xf[e];
                for (int64_t i = 1; i < n; i++) acc += pre[i] * xf[i * d + e];
                act_put(h, bf16, r * d + e, acc);
            }
            continue;
        }
        for (int64_t i = 0; i < n; i++) post[r * n + i] = 2.0f * sigmoid(m[n + i] * scale[1] + base[n + i]);
        float* c = comb + r * n * n;
        for (int64_t i = 0; i < n * n; i++) c[i] = m[2 * n + i] * scale[2] + base[2 * n + i];
        for (int64_t i = 0; i < n; i++) {  // softmax over each row
            float mx = c[i * n];
            for (int64_t o = 1; o < n; o++) mx = std::fmax(mx, c[i * n + o]);
            float s = 0.0f;
            for (int64_t o = 0; o < n; o++) s += (c[i * n + o] = std::exp(c[i * n + o] - mx));
            for (int64_t o = 0; o < n; o++) c[i * n + o] = c[i * n + o] / s + eps;
        }
        for (int64_t it = 0; it < iters; it++) {
            if (it > 0)
                for (int64_t i = 0; i < n; i++) {  // rows
                    float s = 0.0f;
                    for (int64_t o = 0; o < n; o++) s += c[i * n + o];
                    for (int64_t o = 0; o < n; o++) c[i * n + o] /= s + eps;
                }
            for (int64_t o = 0; o < n; o++) {  // columns
                float s = 0.0f;
                for (int64_t i = 0; i < n; i++) s += c[i * n + o];
                for (int64_t i = 0; i < n; i++) c[i * n + o] /= s + eps;
            }
        }
        // collapse in stream order, rounded to x's dtype, then the RMSNorm (x * rsqrt(mean(x^2) + eps), then weight)
        for (int64_t e = 0; e < d; e++) {
            float acc = pre[0] * xf[e];
            for (int64_t i = 1; i < n; i++) acc += pre[i] * xf[i * d + e];
            act_put(h, bf16, r * d + e, acc);
            xf[e] = act_at(h, bf16, r * d + e);  // stream 0's values are no longer needed
        }
        const float hs = 1.0f / std::sqrt(dot8_at(xf, xf, d, isa) / static_cast<float>(d) + norm_eps);
        for (int64_t e = 0; e < d; e++) act_put(h, bf16, r * d + e, weight[e] * (xf[e] * hs));
    }
    note_read(fn, mix * k * int64_t(sizeof(float)));
    return 0;
}

// A site's post step and the next site's pre step in one call (mhcrun.nki.ops.hc_post_pre): mhc_hc_post of (y, res,
// post, comb) into x_new [t, n, d], then mhc_hc_pre of x_new (post_out, comb_out: the pre step's mixes); with y null,
// mhc_hc_pre of res alone (x_new unused). Their codes.
int mhc_hc_post_pre(int bf16, const void* y, const void* res, const float* post, const float* comb, void* x_new,
                    const float* fn, const float* scale, const float* base, const float* weight, void* h,
                    float* post_out, float* comb_out, int64_t t, int64_t n, int64_t d, int64_t iters, float eps,
                    float norm_eps, float* work, int isa, int threads) {
    const int rc = y ? mhc_hc_post(bf16, y, res, post, comb, x_new, t, n, d, isa, threads) : 0;
    return rc ? rc : mhc_hc_pre(bf16, y ? x_new : res, fn, scale, base, weight, h, post_out, comb_out, t, n, d, iters,
                                eps, norm_eps, work, isa, threads);
}

// mhcrun.ops.kvcache.decode of the fp8 format (the kv cache with the quantisation simulated) in fp32, bitwise: each
// row's e4m3 codes [nope] times their block's scale (scales [rows, ceil(nope / block)] fp32: one rounding, as
// torch's product; NaN codes give NaN: decode_block), then its rope channels [rd] copied: out [rows, nope + rd]. Rows
// split over `threads`.
int mhc_kv_fp8_decode(const uint8_t* codes, const float* scale, const float* rope, float* out, int64_t rows,
                      int64_t nope, int64_t block, int64_t rd, int isa, int threads) {
    if (isa < 0 || isa > mhc_qgemv_isa()) return 3;
    const int64_t sb = (nope + block - 1) / block, width = nope + rd;
    int flush = 0;
    const unsigned caller = _mm_getcsr();
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : flush)
    for (int64_t r = 0; r < rows; r++) {
        flush |= take_caller_mode(caller);
        decode_fp8_entry(codes + r * nope, scale + r * sb, rope + r * rd, out + r * width, nope, block, rd, isa);
    }
    return flush ? 5 : 0;
}

// mhcrun.ops.kvcache.decode of the fp4 format (indexer keys) in fp32, bitwise: each row's packed e2m1 codes [k / 2]
// (low nibble first) times their block's scale (scales [rows, ceil(k / block)] fp32: one rounding, as torch's
// product: decode_block) -> out [rows, k]. Returns 5 where the thread flushes subnormals.
int mhc_kv_fp4_decode(const uint8_t* packed, const float* scale, float* out, int64_t rows, int64_t k, int64_t block,
                      int isa) {
    if (isa < 0 || isa > mhc_qgemv_isa()) return 3;
    if (flushes_denormals()) return 5;
    const int64_t sb = (k + block - 1) / block;
    for (int64_t r = 0; r < rows; r++) decode_fp4_entry(packed + r * (k / 2), scale + r * sb, out + r * k, k, block, isa);
    return 0;
}

// The indexer's scores and top-k of a few queries over the fp4 index-key cache (mhcrun.model.Indexer.forward:
// index_scores, then select_topk's tie rule) in one call: q [b, s, h, d] fp32 (the rounded queries), w [b, s, h] fp32
// (the heads' weights), the cache packed [n_rows, len, d / 2] uint8 and scale [n_rows, len, ceil(d / block)] fp32 of
// which rows[i] is batch row i's; query (i, t) scores entries j < n: score = sum over heads, in head order, of
// relu(q_h . key_j) * w_h (each key decoded bitwise as mhc_kv_fp4_decode; the dot products within rounding of torch's:
// sixteen lanes with isa >= 2, else eight), entries j >= closed[i, t] invalid. -> entries [b, s, kk] int64 and valid
// [b, s, kk] (bool bytes), kk = min(topk, n), as select_topk gives them: by rank key (the score's order, -0.0 as 0.0,
// then the lower entry first), largest first; an invalid slot is entry 0, not valid. Returns 6 for a row or n outside
// the cache, 7 for a NaN score (the caller then takes torch's path, whose keys order NaN), 4 out of memory, 5 where the
// thread flushes subnormals. The entries' decoding and scoring go to `threads` threads, KEY_RUN entries a task.
int mhc_index_topk(const float* q, const float* w, const uint8_t* packed, const float* scale, const int64_t* rows,
                   const int64_t* closed, int64_t* entries, uint8_t* valid, int64_t b, int64_t s, int64_t h, int64_t d,
                   int64_t n_rows, int64_t len, int64_t n, int64_t topk, int64_t block, int isa, int threads) {
    if (isa < 0 || isa > mhc_qgemv_isa()) return 3;
    if (flushes_denormals()) return 5;
    if (n < 1 || n > len || d % 2) return 6;
    for (int64_t i = 0; i < b; i++)
        if (rows[i] < 0 || rows[i] >= n_rows) return 6;
    const int64_t sb = (d + block - 1) / block, kk = topk < n ? topk : n;
    constexpr int64_t INVALID = INT64_MIN, LOW = 0xFFFFFFFFLL;
    // KEY_RUN entries a task: their lines asked for together, decoded into the thread's own scratch, scored for each
    // of the row's s queries (scores [s, n]: the same operations as one entry at a time); then each query's top-k on
    // the calling thread. A decode step's call after 1,024 tokens ~140 -> ~80 us (2-core AMX VM, BENCHMARKS.md).
    constexpr int64_t KEY_RUN = 16;
    std::vector<int64_t> rank;
    std::vector<float> scores;
    try {
        rank.resize(n), scores.resize(s * n);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    const unsigned caller = _mm_getcsr();
    for (int64_t i = 0; i < b; i++) {
        const int64_t row = rows[i] * len;
        const int r = for_each_index((n + KEY_RUN - 1) / KEY_RUN, threads, [&](int64_t u) {
            take_caller_mode(caller);  // the caller does not flush (above)
            thread_local std::vector<float> keys;
            try {
                if (static_cast<int64_t>(keys.size()) < KEY_RUN * d) keys.resize(KEY_RUN * d);
            } catch (const std::bad_alloc&) {
                return 4;
            }
            const int64_t j0 = u * KEY_RUN, j1 = std::min(j0 + KEY_RUN, n);
            for (int64_t j = j0; j < j1; j++)
                ask_lines(packed + (row + j) * (d / 2), d / 2), ask_lines(scale + (row + j) * sb, sb * 4);
            for (int64_t j = j0; j < j1; j++)
                decode_fp4_entry(packed + (row + j) * (d / 2), scale + (row + j) * sb, keys.data() + (j - j0) * d, d,
                                 block, isa);
            for (int64_t t = 0; t < s; t++) {
                const int64_t qi = i * s + t;
                for (int64_t j = j0; j < j1; j++) {
                    float score = 0.0f;
                    for (int64_t hh = 0; hh < h; hh++) {
                        const float dp = dot(q + (qi * h + hh) * d, keys.data() + (j - j0) * d, d, isa);
                        score += (dp < 0.0f ? 0.0f : dp) * w[qi * h + hh];  // relu, NaN kept
                    }
                    scores[t * n + j] = score;
                }
            }
            return 0;
        });
        if (r) return 4;
        for (int64_t t = 0; t < s; t++) {
            const int64_t qi = i * s + t;
            for (int64_t j = 0; j < n; j++) {
                const float score = scores[t * n + j];
                if (std::isnan(score)) return 7;
                const int32_t bits = static_cast<int32_t>(bits_of(score + 0.0f));  // + 0.0 turns -0.0 into 0.0
                const int32_t order = bits ^ ((bits >> 31) & 0x7FFFFFFF);  // in the floats' order
                rank[j] = j < closed[qi] ? static_cast<int64_t>(static_cast<uint64_t>(static_cast<int64_t>(order))
                                                                << 32) | (LOW - j)
                                         : INVALID;
            }
            std::partial_sort(rank.begin(), rank.begin() + kk, rank.end(), std::greater<int64_t>());
            for (int64_t m = 0; m < kk; m++) {
                const bool ok = rank[m] != INVALID;
                entries[qi * kk + m] = ok ? LOW - (rank[m] & LOW) : 0;
                valid[qi * kk + m] = ok;
            }
        }
    }
    return 0;
}

// Greedy decoding's pick from logits [rows, v] fp32 (mhcrun.generate.nonfinite_rows, then the argmax of the finite
// rows) in one pass a row and a short second one: kind[r] 1 where row r holds a NaN, else 2 where it holds an infinity,
// else 0 and ids[r] the index of its largest value, the first of equal ones (torch's argmax; -0.0 equals 0.0). isa >= 2:
// sixteen values a step (AVX-512), else one by one. A row of 32,768 logits just written by the head: ~5 us, where
// torch's sum, isfinite, all and argmax took ~180.
static AVX512 void greedy_row_avx512(const float* x, int64_t v, int64_t& id, uint8_t& kind) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0, inf = 0;
    const __m512 pinf = _mm512_set1_ps(INFINITY);
    for (int64_t i = 0; i < v; i += 16) {
        const __mmask16 live = avx512::tail16(v - i);
        const __m512 a = _mm512_maskz_loadu_ps(live, x + i);
        nan |= _mm512_mask_cmp_ps_mask(live, a, a, _CMP_UNORD_Q);
        inf |= _mm512_mask_cmp_ps_mask(live, _mm512_abs_ps(a), pinf, _CMP_EQ_OQ);
        mx = _mm512_mask_max_ps(mx, live, mx, a);
    }
    kind = nan ? 1 : inf ? 2 : 0;
    if (kind) return;
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int64_t i = 0; i < v; i += 16) {
        const __mmask16 live = avx512::tail16(v - i);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(live, _mm512_maskz_loadu_ps(live, x + i), best, _CMP_EQ_OQ);
        if (hit) {
            id = i + __builtin_ctz(hit);
            return;
        }
    }
}

static void greedy_row(const float* x, int64_t v, int64_t& id, uint8_t& kind) {
    bool nan = false, inf = false;
    float mx = -INFINITY;
    for (int64_t i = 0; i < v; i++) {
        nan |= std::isnan(x[i]), inf |= std::isinf(x[i]);
        mx = x[i] > mx ? x[i] : mx;
    }
    kind = nan ? 1 : inf ? 2 : 0;
    if (kind) return;
    for (int64_t i = 0; i < v; i++)
        if (x[i] == mx) {
            id = i;
            return;
        }
}

int mhc_greedy(const float* logits, int64_t rows, int64_t v, int64_t* ids, uint8_t* kind, int isa) {
    if (isa < 0 || isa > mhc_qgemv_isa()) return 3;
    for (int64_t r = 0; r < rows; r++) {
        ids[r] = 0;
        if (isa >= 2) greedy_row_avx512(logits + r * v, v, ids[r], kind[r]);
        else greedy_row(logits + r * v, v, ids[r], kind[r]);
    }
    return 0;
}

// mhcrun.ops.attention.window_mask: which window keys each query of a chunk of s tokens at positions start[i] + [0, s)
// sees -> out [b, s, window + s] (bool bytes): the ring's slots (slot j holds the latest position before start that is
// j mod window) within the query's window, then the chunk's own entries t' <= t within it.
int mhc_window_mask(const int64_t* start, uint8_t* out, int64_t b, int64_t s, int64_t window) {
    const int64_t width = window + s;
    for (int64_t i = 0; i < b; i++)
        for (int64_t t = 0; t < s; t++) {
            uint8_t* m = out + (i * s + t) * width;
            for (int64_t j = 0; j < window; j++) {
                const int64_t back = ((start[i] - 1 - j) % window + window) % window;  // Python's modulo
                const int64_t held = start[i] - 1 - back;
                m[j] = held >= 0 && held > start[i] + t - window;
            }
            for (int64_t u = 0; u < s; u++) m[window + u] = t - u >= 0 && t - u < window;
        }
    return 0;
}

// A compressor's decode step that closes no group (mhcrun.model.Compressor.forward, `stays_open`), bitwise: the score's
// positional bias added (score + ape[p % ratio], one rounding as torch's add), then
// mhcrun.ops.compress.add_to_open_group: token t of row i (position p = start[i] + t) into slot lead + start[i] % ratio
// + t of state row rows[i]. kv, score [b, s, c] fp32 (score before the bias), ape [ratio, c]; kv_state, score_state [B,
// len, c]. 6 where a slot or a state row falls outside the buffers.
int mhc_open_group(float* kv_state, float* score_state, const int64_t* rows, const float* kv, const float* score,
                   const float* ape, const int64_t* start, int64_t b, int64_t s, int64_t c, int64_t n_rows, int64_t len,
                   int64_t ratio, int64_t lead) {
    for (int64_t i = 0; i < b; i++)
        if (rows[i] < 0 || rows[i] >= n_rows || start[i] < 0 || lead + start[i] % ratio + s > len) return 6;
    for (int64_t i = 0; i < b; i++)
        for (int64_t t = 0; t < s; t++) {
            const int64_t at = (rows[i] * len + lead + start[i] % ratio + t) * c;
            put_token(kv_state + at, score_state + at, kv + (i * s + t) * c, score + (i * s + t) * c,
                      ape + ((start[i] + t) % ratio) * c, c);
        }
    return 0;
}

// A compressor's decode step in which a row's token closes its group (mhcrun.model.Compressor.forward: one token a
// row, at position start[i] >= 1; the rows whose token closes its group, start[i] % ratio == ratio - 1, say so in
// closed [b] (bool bytes); at least one does, or the caller's one-call open step applies), on the state rows rows[i]
// of kv_state, score_state [n_rows, len, c] (len = lead + ratio) as mhcrun.ops.compress.compress_chunk leaves them:
// each token into its slot as mhc_open_group puts it; a closed group pooled into pooled [b, c / (lead ? 2 : 1)] (per
// channel, the softmax over the group's slots of the score weighting kv, in fp32: within rounding of torch's softmax
// and sum; with overlap (lead = ratio) the slots [0, ratio) of the previous group's first c / 2 channels, then the
// slots [ratio, 2 ratio) of this group's second half; zeros for a row that closes none), and its state moved on: the
// last `lead` slots become the first, the open group's slots zero kv and -inf score. 6 where a state row (or a row
// twice) or a start does not fit, or no row closes (nothing written).
int mhc_close_group(float* kv_state, float* score_state, const int64_t* rows, const float* kv, const float* score,
                    const float* ape, const int64_t* start, float* pooled, uint8_t* closed, int64_t b, int64_t c,
                    int64_t n_rows, int64_t len, int64_t ratio, int64_t lead) {
    if (len != lead + ratio || (lead && lead != ratio) || (lead && c % 2)) return 6;
    bool any = false;
    for (int64_t i = 0; i < b; i++) {
        if (rows[i] < 0 || rows[i] >= n_rows || start[i] < 1) return 6;
        for (int64_t j = 0; j < i; j++)
            if (rows[j] == rows[i]) return 6;
        any |= start[i] % ratio == ratio - 1;
    }
    if (!any) return 6;
    const int64_t d = lead ? c / 2 : c, span = lead + ratio;
    for (int64_t i = 0; i < b; i++) {
        float* ks = kv_state + rows[i] * len * c;
        float* ss = score_state + rows[i] * len * c;
        const int64_t at = (lead + start[i] % ratio) * c;
        put_token(ks + at, ss + at, kv + i * c, score + i * c, ape + (start[i] % ratio) * c, c);
        closed[i] = start[i] % ratio == ratio - 1;
        if (!closed[i]) {
            std::fill(pooled + i * d, pooled + (i + 1) * d, 0.0f);
            continue;
        }
        for (int64_t e = 0; e < d; e++) {
            float mx = -INFINITY;  // slot m's channel: the first half in the previous group's slots, else the second
            for (int64_t m = 0; m < span; m++) mx = std::fmax(mx, ss[m * c + (lead && m >= lead ? d : 0) + e]);
            float sum = 0.0f, acc = 0.0f;
            for (int64_t m = 0; m < span; m++) {
                const int64_t ch = m * c + (lead && m >= lead ? d : 0) + e;
                const float p = std::exp(ss[ch] - mx);
                sum += p;
                acc += ks[ch] * p;
            }
            pooled[i * d + e] = acc / sum;
        }
        std::memmove(ks, ks + ratio * c, sizeof(float) * lead * c);
        std::memmove(ss, ss + ratio * c, sizeof(float) * lead * c);
        for (int64_t m = lead * c; m < len * c; m++) {
            ks[m] = 0.0f;
            ss[m] = -INFINITY;
        }
    }
    return 0;
}

// A compressor's decode step (mhcrun.model.Compressor.forward's static path: one token a row, at positions start[i] >=
// 1): mhc_close_group where some row's token closes its group, else mhc_open_group of each row's token with pooled
// and closed zeroed. Arguments as mhc_close_group's; 6 where a start is below 1 (a sequence's first token: the
// reference empties its state first) or the buffers do not fit (nothing written).
int mhc_compress_step(float* kv_state, float* score_state, const int64_t* rows, const float* kv, const float* score,
                      const float* ape, const int64_t* start, float* pooled, uint8_t* closed, int64_t b, int64_t c,
                      int64_t n_rows, int64_t len, int64_t ratio, int64_t lead) {
    if (ratio < 1 || (lead && c % 2)) return 6;
    bool closes = false;
    for (int64_t i = 0; i < b; i++) {
        if (start[i] < 1) return 6;
        closes |= start[i] % ratio == ratio - 1;
    }
    if (closes)
        return mhc_close_group(kv_state, score_state, rows, kv, score, ape, start, pooled, closed, b, c, n_rows, len,
                               ratio, lead);
    if (int rc = mhc_open_group(kv_state, score_state, rows, kv, score, ape, start, b, 1, c, n_rows, len, ratio, lead))
        return rc;
    std::fill(pooled, pooled + b * (lead ? c / 2 : c), 0.0f);
    std::fill(closed, closed + b, uint8_t(0));
    return 0;
}

// mhcrun.ops.norm.rms_norm of fp32 rows x [rows, d] with weight [d] (null: none) -> out [rows, d]: x * (1 /
// sqrt(mean(x^2) + eps)), then weight times it, each product rounded as torch rounds it (no FMA); the mean of squares within rounding of
// torch's (summed in another order: sixteen lanes of FMAs with isa >= 2, else eight lanes). 3 for an isa this CPU
// lacks, 5 where the thread flushes subnormals.
int mhc_rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t d, float eps, int isa) {
    if (isa < 0 || isa > mhc_qgemv_isa()) return 3;
    if (flushes_denormals()) return 5;
    const float inv_d = 1.0f / static_cast<float>(d);
    for (int64_t r = 0; r < rows; r++) {
        const float* v = x + r * d;
        const float ms = dot(v, v, d, isa) * inv_d;
        const float rs = 1.0f / std::sqrt(ms + eps);
        for (int64_t e = 0; e < d; e++) out[r * d + e] = w ? w[e] * (v[e] * rs) : v[e] * rs;
    }
    return 0;
}

// mhcrun.ops.rope.apply_rope_tail for fp32, bitwise (each product rounded, then their difference or sum, as torch's
// elementwise ops: plain C++, no FMA): x [rows, g, dim] -> out, the last `rd` channels of each of a row's g vectors
// rotated pairwise (2i, 2i + 1) by the row's cos, sin [rows, rd / 2] (inverse: by -sin), the others copied; a
// prefill's many rows split over `threads` threads (one pass where torch's rotation and concatenation take several).
int mhc_rope_tail(const float* x, const float* cos, const float* sin, float* out, int64_t rows, int64_t g,
                  int64_t dim, int64_t rd, int inverse, int threads) {
    const int64_t half = rd / 2, nope = dim - rd;
    const unsigned caller = _mm_getcsr();
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * g * dim >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        take_caller_mode(caller);  // subnormal products as the caller's thread rounds them
        const float* c = cos + r * half;
        const float* s = sin + r * half;
        for (int64_t v = 0; v < g; v++) {
            const float* src = x + (r * g + v) * dim;
            float* dst = out + (r * g + v) * dim;
            std::memcpy(dst, src, sizeof(float) * nope);
            for (int64_t i = 0; i < half; i++) {
                const float a = src[nope + 2 * i], b = src[nope + 2 * i + 1], si = inverse ? -s[i] : s[i];
                dst[nope + 2 * i] = a * c[i] - b * si;
                dst[nope + 2 * i + 1] = a * si + b * c[i];
            }
        }
    }
    return 0;
}

// mhcrun.ops.attention.sparse_attn for fp32 CPU tensors in one call, within rounding of it (its sums in another
// order): q [b, s, h, d], kv [b, n, d] with mask [b, s, n] (bool bytes), sel [b, s, k, d] with smask [b, s, k] (k may
// be 0: both null), sink [h] -> o [b, s, h, d]. Per query and head: p = softmax over the valid keys of both sets of
// q.key * scale, the sink adding exp(sink - max) to the denominator only; o = sum of p * key. A query with no valid
// key gets NaN (as the reference's exp(-inf - -inf)); NaN scores propagate. The (query, head) pairs go to `threads`
// threads, eight heads a task (each key read once for them), in AVX-512 with isa >= 2 (two keys at a time), else
// AVX2. Returns 3 for an isa this CPU lacks (or below AVX2), 4 out of memory, 5 where a thread flushes subnormals.
int mhc_attend(const float* q, const float* kv, const uint8_t* mask, const float* sel, const uint8_t* smask,
               const float* sink, float* o, int64_t b, int64_t s, int64_t h, int64_t n, int64_t k, int64_t d,
               float scale, int isa, int threads) {
    if (isa < 1 || isa > mhc_qgemv_isa()) return 3;
    const int64_t nk = n + k;
    const unsigned caller = _mm_getcsr();
    const int r = head_group_tasks(b * s, h, nk, caller, threads, [&](int64_t row, int64_t h0, int hn, float* sc) {
        const int64_t bi = row / s;  // row: query (bi, si)
        attend::head_group(isa >= 2, hn, q + (row * h + h0) * d, kv + bi * n * d, mask + row * n, n,
                           k ? sel + row * k * d : nullptr, k ? smask + row * k : nullptr, nk, sink + h0, scale, d, sc,
                           o + (row * h + h0) * d);
        return 0;
    });
    return r & 2 ? 4 : r & 1 ? 5 : 0;
}

// Eager decode's attention of one token a row (mhcrun.model.Attention.forward, s = 1) in one call, over the window
// ring and the compressor's entries as they lie in the kv cache's fp8 format (pow2 scales): each row's kv [b, d]
// (nope + rd channels) encoded into the ring (rcodes [n_rows, win, nope], rscale [.., ceil(nope / block)], rrope [..,
// rd]) at slot start[i] % win of row rows[i], bitwise kvcache.encode; then q [b, h, d] attends (mhc_attend's
// sparse_attn, within rounding of it) to the ring's slots holding positions start[i] - ((start[i] - j) mod win) >= 0
// (the window before the token and the token itself, as window_mask gives them) and to the k entries idx [b, k] of
// the compressor's cache (ccodes, cscale, crope [n_rows, c_len, ...]; cvalid [b, k] bool bytes: which count; k may
// be 0), each decoded bitwise as kvcache.decode; sink [h] -> o [b, h, d]. The (row, head group) pairs go to
// `threads` threads. Returns 1 for a non-finite kv (nothing written: the caller takes torch's path), 6 for a row (or a
// row twice), a start or an entry outside the buffers (nothing written), 4 out of memory, 5 where the thread flushes
// subnormals.
int mhc_attend_decode(const float* q, const float* kv, uint8_t* rcodes, float* rscale, float* rrope,
                      const int64_t* rows, const int64_t* start, const uint8_t* ccodes, const float* cscale,
                      const float* crope, const int64_t* idx, const uint8_t* cvalid, const float* sink, float* o,
                      int64_t b, int64_t h, int64_t d, int64_t rd, int64_t block, int64_t n_rows, int64_t win,
                      int64_t c_len, int64_t k, float scale, int isa, int threads) {
    if (isa < 1 || isa > mhc_qgemv_isa()) return 3;
    if (flushes_denormals()) return 5;
    const int64_t nope = d - rd, sb = (nope + block - 1) / block, nk = win + k;
    if (nope < 1 || rd < 0 || win < 1) return 6;
    for (int64_t i = 0; i < b; i++) {
        if (rows[i] < 0 || rows[i] >= n_rows || start[i] < 0) return 6;
        for (int64_t j = 0; j < i; j++)
            if (rows[j] == rows[i]) return 6;
        for (int64_t m = 0; m < k; m++)
            if (idx[i * k + m] < 0 || idx[i * k + m] >= c_len) return 6;
    }
    for (int64_t i = 0; i < b * d; i++)
        if (!std::isfinite(kv[i])) return 1;
    std::vector<uint8_t> mask;
    try {
        mask.resize(b * win);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    for (int64_t i = 0; i < b; i++) {
        const int64_t at = rows[i] * win + start[i] % win;
        encode_fp8_entry(kv + i * d, rcodes + at * nope, rscale + at * sb, rrope + at * rd, nope, block, rd);
        for (int64_t j = 0; j < win; j++) mask[i * win + j] = start[i] - ((start[i] - j) % win + win) % win >= 0;
    }
    const unsigned caller = _mm_getcsr();
    // Each (row, head group) task decodes its row's nk keys into its thread's own scratch (thread_local, kept from call
    // to call), then attends: its scores and sums read keys in this core's caches, where keys decoded once for both
    // groups, half by each thread, left half of every group's reads to the other core's; a key's lines (its codes,
    // scales and rope lie in three arrays) are asked for KEY_RUN keys at a time before they are decoded, where one key
    // at a time waited for each of its misses. A decode step's call of the mid-size config ~118 -> ~64 us (2-core
    // AMX VM, BENCHMARKS.md).
    // A thread that takes two groups of a row (one thread, or the other absent) decodes its keys once: the calls are
    // numbered (`calls`, the process's), and a thread's scratch says which call's row it holds.
    constexpr int64_t KEY_RUN = 8;
    static std::atomic<uint64_t> calls{0};
    const uint64_t call = calls.fetch_add(1, std::memory_order_relaxed) + 1;
    const int r = head_group_tasks(b, h, nk, caller, threads, [&](int64_t i, int64_t h0, int hn, float* sc) {
        thread_local std::vector<float> keys;
        thread_local uint64_t held_call = 0;  // the call and row whose keys `keys` holds
        thread_local int64_t held_row = -1;
        try {
            if (static_cast<int64_t>(keys.size()) < nk * d) keys.resize(nk * d);
        } catch (const std::bad_alloc&) {
            return 2;
        }
        const bool held = held_call == call && held_row == i;
        held_call = call, held_row = i;
        for (int64_t j0 = 0; j0 < nk && !held; j0 += KEY_RUN) {
            const int64_t j1 = std::min(j0 + KEY_RUN, nk);
            const uint8_t* c[KEY_RUN];  // key j's codes, scales and rope at [j - j0]
            const float *ks[KEY_RUN], *rp[KEY_RUN];
            for (int64_t j = j0; j < j1; j++) {
                const int64_t e = j < win ? rows[i] * win + j : rows[i] * c_len + idx[i * k + j - win];
                c[j - j0] = (j < win ? rcodes : ccodes) + e * nope;
                ks[j - j0] = (j < win ? rscale : cscale) + e * sb;
                rp[j - j0] = (j < win ? rrope : crope) + e * rd;
                ask_lines(c[j - j0], nope), ask_lines(ks[j - j0], sb * 4), ask_lines(rp[j - j0], rd * 4);
            }
            for (int64_t j = j0; j < j1; j++)
                decode_fp8_entry(c[j - j0], ks[j - j0], rp[j - j0], keys.data() + j * d, nope, block, rd, isa);
        }
        const float* rk = keys.data();
        attend::head_group(isa >= 2, hn, q + (i * h + h0) * d, rk, mask.data() + i * win, win,
                           k ? rk + win * d : nullptr, k ? cvalid + i * k : nullptr, nk, sink + h0, scale, d, sc,
                           o + (i * h + h0) * d);
        return 0;
    });
    return r & 2 ? 4 : r & 1 ? 5 : 0;
}

// mhcrun.ops.moe's gate_scores and route for t rows (decode's few) in one call: x [t, d], weight [e, d] fp32; the
// scores (score_func 0 softmax, 1 sigmoid, 2 sqrt of softplus (x above 20 kept, as torch's threshold)) of the
// logits x . weight_j (within rounding of torch's: the dot products in another order, exp and log1p of the C
// library); the k experts of each row: hash [t, k] (null: by score) or the k largest scores + bias [e] (null: none),
// largest first, the lower expert first among exact ties (torch.topk leaves their order open) -> idx [t, k] int64 and
// weights [t, k] fp32: the scores chosen (normalised to sum 1 but for softmax) times route_scale. The logits' dot
// products go to `threads` threads. Returns 7 for a NaN score (the caller takes torch's path), 6 for a hash id
// outside [0, e) or k > e.
int mhc_route(const float* x, const float* w, const float* bias, const int64_t* hash, float* weights, int64_t* idx,
              int64_t t, int64_t d, int64_t e, int64_t k, int score_func, float route_scale, int isa, int threads) {
    if (isa < 0 || isa > mhc_qgemv_isa()) return 3;
    if (flushes_denormals()) return 5;
    if (k < 1 || k > e) return 6;
    if (hash)
        for (int64_t i = 0; i < t * k; i++)
            if (hash[i] < 0 || hash[i] >= e) return 6;
    std::vector<float> scores(t * e);
    const unsigned caller = _mm_getcsr();
    for_each_index(t * e, e * d >= 65536 ? threads : 1, [&](int64_t j) {
        take_caller_mode(caller);
        scores[j] = dot(x + j / e * d, w + j % e * d, d, isa);
        return 0;
    });
    note_read(w, e * d * int64_t(sizeof(float)));
    std::vector<int64_t> order(e);
    for (int64_t r = 0; r < t; r++) {
        float* sc = scores.data() + r * e;
        if (score_func == 0) {
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < e; j++) mx = std::fmax(mx, sc[j]);
            for (int64_t j = 0; j < e; j++) sum += (sc[j] = std::exp(sc[j] - mx));
            for (int64_t j = 0; j < e; j++) sc[j] /= sum;
        } else {
            for (int64_t j = 0; j < e; j++)
                sc[j] = score_func == 1 ? 1.0f / (1.0f + std::exp(-sc[j]))
                                        : std::sqrt(sc[j] > 20.0f ? sc[j] : std::log1p(std::exp(sc[j])));
        }
        for (int64_t j = 0; j < e; j++)
            if (std::isnan(sc[j])) return 7;
        int64_t* ids = idx + r * k;
        if (hash) {
            std::memcpy(ids, hash + r * k, sizeof(int64_t) * k);
        } else {
            for (int64_t j = 0; j < e; j++) order[j] = j;
            const auto biased = [&](int64_t j) { return bias ? sc[j] + bias[j] : sc[j]; };
            std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
                const float va = biased(a), vb = biased(b);
                return va > vb || (va == vb && a < b);
            });
            std::memcpy(ids, order.data(), sizeof(int64_t) * k);
        }
        float* wt = weights + r * k;
        float sum = 0.0f;
        for (int64_t m = 0; m < k; m++) sum += (wt[m] = sc[ids[m]]);
        for (int64_t m = 0; m < k; m++) wt[m] = (score_func == 0 ? wt[m] : wt[m] / sum) * route_scale;
    }
    return 0;
}

// The best instruction set of this CPU the kernel has: 3 AVX-512 with BF16 dot products (also VNNI, VBMI, BMI2), 2
// AVX-512 (F, BW, VL), 1 AVX2, 0 neither (all also need F16C and FMA).
int mhc_qgemv_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("f16c") || !__builtin_cpu_supports("fma")) return 0;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") &&
                       __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("bmi2") ? 3 : 2;
    return __builtin_cpu_supports("avx2") ? 1 : 0;
}

// Whether x [n] takes the BF16 dot-product rows (avx512bf16::takes_bf16): exact in bf16, each value zero or finite
// and at least 2**-110 in magnitude. 1 or 0.
int mhc_takes_bf16(const float* x, int64_t n) {
    return mhc_qgemv_isa() == 3 && avx512bf16::takes_bf16(x, n) ? 1 : 0;
}

// Whether panels take a prefill's rows of a weight of k inputs whose scales are its own (k / block a row): AVX2's
// (panel_layout), or with isa 3 on a CPU without AMX (job_panels) the BF16 panels of FP4 and FP8 weights in blocks of
// 32 (gemm::run_job, where x and the scales qualify). 1 or 0.
int mhc_panels_take(int fmt, int scale_kind, int64_t block, int64_t k, int isa) {
    const bool bf16 = isa == 3 && job_panels() && (fmt == FMT_FP4 || fmt == FMT_FP8) && block % 32 == 0;  // run_job's
    return block > 0 && (bf16 || panel_layout(fmt, scale_kind, block, k, k / block, isa)) ? 1 : 0;
}

// Whether x [rows, k] takes the FP4 integer rows of isa 3 and 1 (make_int_x): every value finite, and each
// chunk of 128 inputs of a row within 30 bits of its lowest set bit, inside 2**-125 .. 2**100. 1 or 0.
int mhc_takes_int(const float* x, int64_t rows, int64_t k) {
    IntX unused;
    return make_int_x(x, rows, k, avx512bf16::fp4_slot, 0, unused) ? 1 : 0;
}

// The integer x of rows [rows, k] (make_int_x) into v [rows, chunks, 2, 128], scale and two [rows, chunks]: with `top`,
// the panels' (input order, split at the top bits) by the scalar loop (isa 0) or AVX2's int_chunk_top (isa 1); else
// the AVX-512 rows' (avx512bf16::fp4_slot's order) by the scalar loop (isa 0) or int_chunk_rows (isa 3). For the
// tests, which compare the two. 1, or 0 where x does not qualify or the CPU lacks the isa (nothing written).
int mhc_int_x(const float* x, int64_t rows, int64_t k, int isa, int top, int16_t* v, float* scale, uint8_t* two) {
    IntX out;
    if (isa < 0 || isa > mhc_qgemv_isa() || (isa != 0 && isa != (top ? 1 : 3)) ||
        !make_int_x(x, rows, k, top ? in_order : avx512bf16::fp4_slot, 0, out, top != 0, nullptr, isa))
        return 0;
    std::memcpy(v, out.v.data(), sizeof(int16_t) * out.v.size());
    std::memcpy(scale, out.scale.data(), sizeof(float) * out.scale.size());
    std::memcpy(two, out.two.data(), out.two.size());
    return 1;
}

// The instruction set a run takes unless told otherwise: the best, but AVX-512 without the BF16 dot products on a CPU
// that is neither AMD's nor has AMX. Zen 4 retires vdpbf16ps at the FMA's instruction rate (twice its products): the
// dot rows decode FP8 1.7x and FP4 1.3x faster there; an Intel Xeon (Sapphire Rapids) VM retired it at half the
// FMA's rate, where an early version of these rows ran no faster out of DRAM and slower in L2; on another such VM
// (with AMX) today's rows read FP8 weights out of DRAM at 8.0-9.5 GB/s against 5.5-6.0 and FP4 at 4.9-5.1 against
// 3.7-4.1 (BENCHMARKS.md, issue 20). Other Intel CPUs with AVX-512 BF16 (Cooper Lake) stay unmeasured: avx512.
int mhc_qgemv_default_isa(void) {
    const int best = mhc_qgemv_isa();
    __builtin_cpu_init();
    return best == 3 && !__builtin_cpu_is("amd") && !amx::usable() ? 2 : best;
}

// Whether this CPU and process multiply prefill chunks by AMX tiles (mhc_qgemm_bf16 with isa 4). 1 or 0.
int mhc_qgemm_amx(void) { return mhc_qgemv_isa() == 3 && amx::usable() ? 1 : 0; }

// y [M, N] = x [M, K] . W^T for an fp8 / fp4 weight (see the top of this file) and a chunk of rows: bf16 panels
// (namespace gemm) multiplied by vdpbf16ps (isa 3) or by AMX tiles (isa 4, namespace amx). Returns 7, leaving y as
// it was, where x or the scales do not qualify (gemm::pack_row, gemm::scales_take: the caller then takes its fp32
// path); 3 (the instruction set is not this CPU's or process's), 4, 5 as mhc_qgemv.
int mhc_qgemm_bf16(int fmt, const void* w, const void* s, int scale_kind, const float* x, float* y, int64_t m,
                   int64_t n, int64_t k, int64_t block, int isa, int threads) {
    if ((isa != 3 && isa != 4) || mhc_qgemv_isa() != 3 || (isa == 4 && !amx::usable()) ||
        (fmt != FMT_FP8 && fmt != FMT_FP4))
        return 3;
    if (fmt == FMT_FP4 && block % 2) return 7;
    if (flushes_denormals()) return 5;
    Job j = make_job(fmt, scale_kind, w, s, x, y, m, n, k, block, 1);
    if (!gemm::scales_take(j)) return 7;
    // x in bf16 pairs: row-major (k2 pairs a row), or for AMX in tile order (k2s pairs a row, a whole number of tile
    // steps; ms rows, whole blocks; zero-padded)
    const int64_t k2 = (k + 1) / 2, panels = (n + gemm::NB - 1) / gemm::NB;
    const int64_t k2s = isa == 4 ? (k2 + amx::KT - 1) / amx::KT * amx::KT : k2;
    const int64_t ms = isa == 4 ? (m + amx::MT - 1) / amx::MT * amx::MT : m;
    std::vector<uint32_t> xb;
    try {
        xb.assign(ms * k2s, 0);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : bad)
    for (int64_t r = 0; r < m; r++) {
        uint32_t* out = xb.data() + (isa == 4 ? amx::row_at(r, k2s / amx::KT) : r * k2);
        bad |= gemm::pack_row(x + r * k, k, k2s, out, isa == 4 ? amx::TILE_WORDS : 16) ? 0 : 1;
    }
    if (bad) return 7;
    if (isa == 4) return amx::multiply(j, xb.data(), ms, k2, k2s, threads);
    j.xp = xb.data();
    int oom = 0, flush = 0;
    const unsigned caller = _mm_getcsr();
#pragma omp parallel num_threads(threads) reduction(| : oom, flush)
    {
        flush |= take_caller_mode(caller);
        const int64_t parts = omp_get_num_threads();  // each thread a run of panels (run_job reads the next ahead)
#pragma omp for schedule(static)
        for (int64_t t = 0; t < parts; t++) {
            const int64_t p0 = panels * t / parts, p1 = panels * (t + 1) / parts;
            if (!oom && !flush && p0 < p1)
                oom |= gemm::run_job(j, p0 * gemm::NB, std::min(n, p1 * gemm::NB)) ? 0 : 1;
        }
    }
    return oom ? 4 : flush ? 5 : 0;
}

// y [M, N] = x [M, G, K] . W^T (see the top of this file). x: fp32; fp4 rows are reordered here (`prepare_x`).
// isa: 3 AVX-512 with BF16 dot products where x qualifies, 2 AVX-512, 1 AVX2 (at most mhc_qgemv_isa()). threads:
// how many OpenMP threads to use (torch's intra-op count).
int mhc_qgemv(int fmt, const void* w, const void* s, int scale_kind, const float* x, float* y, int64_t m,
              int64_t n, int64_t k, int64_t block, int64_t groups, int isa, int threads) {
    if (int rc = check_args(fmt, block, isa)) return rc;
    std::vector<Job> jobs{make_job(fmt, scale_kind, w, s, x, y, m, n, k, block, groups)};
    XBuf own;
    if (!prepare_x(jobs[0], isa, own)) return 4;
    return run_jobs(jobs, isa, threads);
}

// x [m, k] as a GEMV is to read it: rounded to FP8 in blocks of act_block into buf, x then pointing there (act_block 0:
// x as given). 0, 1 where the rounding declines (as mhc_act_quant_fp8), 4 out of memory.
int round_rows(const float*& x, int64_t m, int64_t k, int64_t act_block, int isa, int threads,
               std::vector<float>& buf) {
    if (act_block <= 0) return 0;
    try {
        buf.resize(m * k);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    if (mhc_act_quant_fp8(x, buf.data(), m, k, act_block, isa, threads)) return 1;
    x = buf.data();
    return 0;
}

// qlinear's decode GEMV in one call: x [m, k] rounded to FP8 first, in blocks of act_block, as mhc_act_quant_fp8 rounds
// it (act_block 0: x as given), then mhc_qgemv's product with one group. Return codes as mhc_qgemv's, and 1 where the
// rounding declines (non-finite x, a thread flushing subnormals: the caller then takes its torch path).
int mhc_qlinear(int fmt, const void* w, const void* s, int scale_kind, const float* x, float* y, int64_t m, int64_t n,
                int64_t k, int64_t block, int64_t act_block, int isa, int threads) {
    if (int rc = check_args(fmt, block, isa)) return rc;
    std::vector<float> xq;
    if (int rc = round_rows(x, m, k, act_block, isa, threads, xq)) return rc;
    return mhc_qgemv(fmt, w, s, scale_kind, x, y, m, n, k, block, 1, isa, threads);
}

// A weight as the layer-step entry points below take it: int64 [format, its bytes' address, its scales' address (0:
// none), scale kind, rows n, inputs k, block] (mhcrun.ops.qgemv.weight_table).
constexpr int WEIGHT_FIELDS = 7;

// mhc_qlinear of the weight at t (WEIGHT_FIELDS) with `groups` groups of rows (act_block 0 then, as mhc_qgemv).
int qlinear_at(const int64_t* t, const float* x, float* y, int64_t m, int64_t act_block, int64_t groups, int isa,
               int threads) {
    const void* w = reinterpret_cast<const void*>(t[1]);
    const void* s = reinterpret_cast<const void*>(t[2]);
    if (groups > 1) return mhc_qgemv(int(t[0]), w, s, int(t[3]), x, y, m, t[4], t[5], t[6], groups, isa, threads);
    return mhc_qlinear(int(t[0]), w, s, int(t[3]), x, y, m, t[4], t[5], t[6], act_block, isa, threads);
}

// Attention.project of m decode rows in one call: the kernel calls its eager path makes, in its order, so the same
// values (python: CpuKernel.attn_project). qr = rms_norm(wq_a x, q_norm); q = rope(rms_norm of each head of wq_b qr, no
// weight); kv = rope(rms_norm(wkv x, kv_norm)). weights: wq_a, wq_b, wkv (3 x WEIGHT_FIELDS); act_*: their activation
// blocks (0: x as given); x [m, d]; cos, sin [m, rd / 2] -> qr [m, wq_a rows], q [m, heads, hd], kv [m, hd]. The first
// non-zero code of those calls (then nothing is to be used), 4 out of memory.
int mhc_attn_project(const int64_t* weights, int64_t act_a, int64_t act_b, int64_t act_kv, const float* x,
                     const float* q_norm, const float* kv_norm, float eps, const float* cos, const float* sin, float* qr,
                     float* q, float* kv, int64_t m, int64_t heads, int64_t hd, int64_t rd, int isa, int threads) {
    const int64_t *wa = weights, *wb = weights + WEIGHT_FIELDS, *wk = weights + 2 * WEIGHT_FIELDS;
    std::vector<float> t;
    try {
        t.resize(m * (wa[4] + 2 * wb[4] + 2 * hd));
    } catch (const std::bad_alloc&) {
        return 4;
    }
    float *ta = t.data(), *tb = ta + m * wa[4], *tq = tb + m * wb[4], *tk = tq + m * wb[4], *tkn = tk + m * hd;
    if (int rc = qlinear_at(wa, x, ta, m, act_a, 1, isa, threads)) return rc;
    if (int rc = mhc_rms_norm(ta, q_norm, qr, m, wa[4], eps, isa)) return rc;
    if (int rc = qlinear_at(wb, qr, tb, m, act_b, 1, isa, threads)) return rc;
    if (int rc = mhc_rms_norm(tb, nullptr, tq, m * heads, hd, eps, isa)) return rc;
    mhc_rope_tail(tq, cos, sin, q, m, heads, hd, rd, 0, threads);
    if (int rc = qlinear_at(wk, x, tk, m, act_kv, 1, isa, threads)) return rc;
    if (int rc = mhc_rms_norm(tk, kv_norm, tkn, m, hd, eps, isa)) return rc;
    mhc_rope_tail(tkn, cos, sin, kv, m, 1, hd, rd, 0, threads);
    return 0;
}

// mhcrun.ops.quant.hadamard for fp32, bitwise: each row of x [rows, n] (n a power of two) -> out (x itself allowed) by
// the reference's butterflies in its order, for h = 1, 2, ..., n / 2 each pair (i, i + h) of a block of 2h becoming
// (a + b, a - b), then each value times `scale` (the caller's n**-0.5 as fp32, as torch multiplies by it); a prefill's
// many rows split over `threads` threads. 6 where n is not a power of two.
int mhc_hadamard(const float* x, float* out, int64_t rows, int64_t n, float scale, int threads) {
    if (n <= 0 || (n & (n - 1))) return 6;
    const unsigned caller = _mm_getcsr();
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        take_caller_mode(caller);  // subnormal sums and products as the caller's thread rounds them
        float* y = out + r * n;
        if (y != x + r * n) std::memcpy(y, x + r * n, sizeof(float) * n);
        for (int64_t h = 1; h < n; h *= 2)
            for (int64_t b0 = 0; b0 < n; b0 += 2 * h)
                for (int64_t i = b0; i < b0 + h; i++) {
                    const float a = y[i], b = y[i + h];
                    y[i] = a + b;
                    y[i + h] = a - b;
                }
        for (int64_t i = 0; i < n; i++) y[i] *= scale;
    }
    return 0;
}

// Indexer.queries of m decode rows in one call, as mhc_attn_project (python: CpuKernel.index_queries): q = wq_b qr
// (its activation block act_b) as [m, heads, hd], RoPE on each head's tail by cos, sin [m, rd / 2], the Hadamard
// rotation of each head (mhc_hadamard by `scale`), then with fp4_block > 0 the FP4 rounding in blocks of it
// (mhc_fp4_simulate) -> q [m, heads, hd]. weights: wq_b (WEIGHT_FIELDS). Codes as those calls', 4 out of memory.
int mhc_index_queries(const int64_t* weights, int64_t act_b, const float* qr, const float* cos, const float* sin,
                      float* q, int64_t m, int64_t heads, int64_t hd, int64_t rd, float scale, int64_t fp4_block,
                      int isa, int threads) {
    std::vector<float> t;
    try {
        t.resize(m * heads * hd);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    if (int rc = qlinear_at(weights, qr, t.data(), m, act_b, 1, isa, threads)) return rc;
    mhc_rope_tail(t.data(), cos, sin, q, m, heads, hd, rd, 0, threads);
    if (int rc = mhc_hadamard(q, q, m * heads, hd, scale, threads)) return rc;
    return fp4_block > 0 ? mhc_fp4_simulate(q, m * heads, hd, fp4_block, threads) : 0;
}

// Attention.output of m decode rows in one call, as mhc_attn_project (python: CpuKernel.attn_output): o [m, heads, hd]
// rotated back (inverse rope by cos, sin [m, rd / 2]), wo_a's grouped product of it as [m, groups, heads * hd /
// groups], then wo_b of that (its activation block act_b) -> out [m, wo_b rows].
int mhc_attn_output(const int64_t* weights, int64_t act_b, const float* o, const float* cos, const float* sin,
                    float* out, int64_t m, int64_t heads, int64_t hd, int64_t rd, int64_t groups, int isa,
                    int threads) {
    const int64_t *wa = weights, *wb = weights + WEIGHT_FIELDS;
    std::vector<float> t;
    try {
        t.resize(m * (heads * hd + wa[4]));
    } catch (const std::bad_alloc&) {
        return 4;
    }
    float *to = t.data(), *ta = to + m * heads * hd;
    mhc_rope_tail(o, cos, sin, to, m, heads, hd, rd, 1, threads);
    if (int rc = qlinear_at(wa, to, ta, m, 0, groups, isa, threads)) return rc;
    return qlinear_at(wb, ta, out, m, act_b, 1, isa, threads);
}

// Attention.forward's attention and output of b decode rows (one token a row) in one call, as mhc_attn_project (python:
// CpuKernel.attend_output): mhc_attend_decode (its arguments but o), then mhc_attn_output of its o (its arguments but
// o: weights wo_a, wo_b, act_b, cos, sin, out [m, wo_b rows], m, heads, hd, rd, groups, out_isa, out_threads; m, heads,
// hd, rd those of the attention, else 6). Codes as those calls' (where the second fails, the first has written the
// token's kv into the ring: the caller's calls write the same), 4 out of memory.
int mhc_attend_output(const float* q, const float* kv, uint8_t* rcodes, float* rscale, float* rrope,
                      const int64_t* rows, const int64_t* start, const uint8_t* ccodes, const float* cscale,
                      const float* crope, const int64_t* idx, const uint8_t* cvalid, const float* sink, int64_t b,
                      int64_t h, int64_t d, int64_t rd, int64_t block, int64_t n_rows, int64_t win, int64_t c_len,
                      int64_t k, float scale, int isa, int threads, const int64_t* weights, int64_t act_b,
                      const float* cos, const float* sin, float* out, int64_t m, int64_t heads, int64_t hd,
                      int64_t out_rd, int64_t groups, int out_isa, int out_threads) {
    if (m != b || heads != h || hd != d || out_rd != rd) return 6;
    std::vector<float> o;
    try {
        o.resize(b * h * d);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    if (int rc = mhc_attend_decode(q, kv, rcodes, rscale, rrope, rows, start, ccodes, cscale, crope, idx, cvalid, sink,
                                   o.data(), b, h, d, rd, block, n_rows, win, c_len, k, scale, isa, threads))
        return rc;
    return mhc_attn_output(weights, act_b, o.data(), cos, sin, out, m, heads, hd, out_rd, groups, out_isa,
                           out_threads);
}

// Compressor.forward of decode tokens that close no group, in one call, as mhc_attn_project (python:
// CpuKernel.compress_open): kv = wkv x, score = wgate x (act_*: their activation blocks), then mhc_open_group of them.
// weights: wkv, wgate (2 x WEIGHT_FIELDS, c rows each); x [b, s, d]; the rest as mhc_open_group's. Codes as those
// calls', 4 out of memory.
int mhc_compress_open(const int64_t* weights, int64_t act_kv, int64_t act_gate, const float* x, float* kv_state,
                      float* score_state, const int64_t* rows, const float* ape, const int64_t* start, int64_t b,
                      int64_t s, int64_t n_rows, int64_t len, int64_t ratio, int64_t lead, int isa, int threads) {
    const int64_t *wk = weights, *wg = weights + WEIGHT_FIELDS, c = wk[4], m = b * s;
    std::vector<float> t;
    try {
        t.resize(2 * m * c);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    float *kv = t.data(), *score = kv + m * c;
    if (int rc = qlinear_at(wk, x, kv, m, act_kv, 1, isa, threads)) return rc;
    if (int rc = qlinear_at(wg, x, score, m, act_gate, 1, isa, threads)) return rc;
    return mhc_open_group(kv_state, score_state, rows, kv, score, ape, start, b, s, c, n_rows, len, ratio, lead);
}

// A compressor's decode step that closes no group, then the attention with its output, in one call (python:
// CpuKernel.attend_output with `opened`; Attention.forward's calls in its order): mhc_compress_open (its arguments),
// then mhc_attend_output (its arguments). Their codes; where the second fails, the first has put the tokens into the
// open groups' slots and the second may have put them into the ring: the caller's calls write the same there.
int mhc_open_attend_output(const int64_t* cweights, int64_t act_kv, int64_t act_gate, const float* x, float* kv_state,
                           float* score_state, const int64_t* crows, const float* ape, const int64_t* cstart,
                           int64_t cb, int64_t cs, int64_t c_n_rows, int64_t len, int64_t ratio, int64_t lead,
                           int c_isa, int c_threads, const float* q, const float* kv, uint8_t* rcodes, float* rscale,
                           float* rrope, const int64_t* rows, const int64_t* start, const uint8_t* ccodes,
                           const float* cscale, const float* crope, const int64_t* idx, const uint8_t* cvalid,
                           const float* sink, int64_t b, int64_t h, int64_t d, int64_t rd, int64_t block,
                           int64_t n_rows, int64_t win, int64_t c_len, int64_t k, float scale, int isa, int threads,
                           const int64_t* weights, int64_t act_b, const float* cos, const float* sin, float* out,
                           int64_t m, int64_t heads, int64_t hd, int64_t out_rd, int64_t groups, int out_isa,
                           int out_threads) {
    if (int rc = mhc_compress_open(cweights, act_kv, act_gate, x, kv_state, score_state, crows, ape, cstart, cb, cs,
                                   c_n_rows, len, ratio, lead, c_isa, c_threads))
        return rc;
    return mhc_attend_output(q, kv, rcodes, rscale, rrope, rows, start, ccodes, cscale, crope, idx, cvalid, sink, b, h,
                             d, rd, block, n_rows, win, c_len, k, scale, isa, threads, weights, act_b, cos, sin, out, m,
                             heads, hd, out_rd, groups, out_isa, out_threads);
}

// A compressor's closed groups finished and stored in one call (python: CpuKernel.store_entries), as its eager calls
// make them (mhcrun.model.Compressor.forward, finish_entry, encode_entries, Cache.store), so the same values: each of
// the n normed groups [n, hd] with RoPE on its tail at its group's first position (mhc_rope_tail by the rows first[i]
// of the tables cos, sin [positions, rd / 2]), with spin != 0 the Hadamard rotation (mhc_hadamard by spin), encoded
// (kind 0: the kv cache's fp8 format, mhc_kv_fp8_encode with `rd` rope channels; 1: the indexer keys' fp4,
// mhc_kv_fp4_encode; blocks of `block`) and written to entry slot[i] of cache row at[i]: codes [n_rows, c_len, hd - rd]
// (fp8) or [.., hd / 2] (fp4), scales [.., ceil((hd - rd) / block)] (fp4: hd), rope [.., rd] (fp8). Nothing is
// written where a call declines (its code; non-finite entries: 1) or a row, slot or position lies outside the buffers
// (6); 4 out of memory.
int mhc_store_entries(const float* normed, const int64_t* at, const int64_t* slot, const int64_t* first, int64_t n,
                      int64_t hd, const float* cos, const float* sin, int64_t positions, int64_t rd, float spin,
                      int kind, uint8_t* codes, float* scales, float* rope, int64_t n_rows, int64_t c_len,
                      int64_t block, int isa) {
    const int64_t half = rd / 2, width = kind == 0 ? hd - rd : hd, code_bytes = kind == 0 ? width : hd / 2;
    const int64_t sb = (width + block - 1) / block;
    if ((kind != 0 && kind != 1) || rd % 2 || rd > hd || (kind == 1 && hd % 2) || block < 1) return 6;
    for (int64_t i = 0; i < n; i++)
        if (at[i] < 0 || at[i] >= n_rows || slot[i] < 0 || slot[i] >= c_len || first[i] < 0 || first[i] >= positions)
            return 6;
    std::vector<float> out, tc, ts, sc, rp;
    std::vector<uint8_t> tb;
    try {
        out.resize(n * hd), tc.resize(n * half), ts.resize(n * half), tb.resize(n * code_bytes), sc.resize(n * sb);
        rp.resize(kind == 0 ? n * rd : 0);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    for (int64_t i = 0; i < n; i++) {  // the tables' rows at the groups' first positions, as Rope.at gathers them
        std::memcpy(tc.data() + i * half, cos + first[i] * half, sizeof(float) * half);
        std::memcpy(ts.data() + i * half, sin + first[i] * half, sizeof(float) * half);
    }
    mhc_rope_tail(normed, tc.data(), ts.data(), out.data(), n, 1, hd, rd, 0, 1);
    if (spin != 0.0f)
        if (int rc = mhc_hadamard(out.data(), out.data(), n, hd, spin, 1)) return rc;
    if (int rc = kind == 0 ? mhc_kv_fp8_encode(out.data(), tb.data(), sc.data(), rp.data(), n, width, block, rd)
                           : mhc_kv_fp4_encode(out.data(), tb.data(), sc.data(), n, hd, block))
        return rc;
    for (int64_t i = 0; i < n; i++) {
        const int64_t e = at[i] * c_len + slot[i];
        std::memcpy(codes + e * code_bytes, tb.data() + i * code_bytes, code_bytes);
        std::memcpy(scales + e * sb, sc.data() + i * sb, sizeof(float) * sb);
        if (kind == 0) std::memcpy(rope + e * rd, rp.data() + i * rd, sizeof(float) * rd);
    }
    return 0;
}

// Transformer.finish of t decode rows in one call (python: CpuKernel.finish): the carried post step (mhc_hc_post of y
// [t, d], res [t, n, d], post [t, n], comb [t, n, n] into the streams x_new [t, n, d]), V4's head collapse of them
// (mhc_hc_pre without post: fn [n, n * d], scale [1], base [n], eps, hc_norm_eps), the final norm (mhc_rms_norm by
// norm [d], norm_eps) and the head (`head`: a weight as WEIGHT_FIELDS; act its activation block) -> logits [t, vocab]:
// the calls of its eager path in its order, so the same values (fp32 activations). Their codes, 4 out of memory.
int mhc_finish(const float* y, const float* res, const float* post, const float* comb, float* x_new, const float* fn,
               const float* scale, const float* base, float eps, float hc_norm_eps, const float* norm, float norm_eps,
               const int64_t* head, int64_t act, float* logits, int64_t t, int64_t n, int64_t d, int isa,
               int threads) {
    std::vector<float> h;
    try {
        h.resize(2 * t * d);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    if (int rc = mhc_hc_post(0, y, res, post, comb, x_new, t, n, d, isa, threads)) return rc;
    if (int rc = mhc_hc_pre(0, x_new, fn, scale, base, nullptr, h.data(), nullptr, nullptr, t, n, d, 0, eps,
                            hc_norm_eps, nullptr, isa, threads))
        return rc;
    if (int rc = mhc_rms_norm(h.data(), norm, h.data() + t * d, t, d, norm_eps, isa)) return rc;
    return qlinear_at(head, h.data() + t * d, logits, t, act, 1, isa, threads);
}

// Whether every index of idx [count] names one of `experts` experts.
inline bool in_set(const int64_t* idx, int64_t count, int64_t experts) {
    for (int64_t p = 0; p < count; p++)
        if (idx[p] < 0 || idx[p] >= experts) return false;
    return true;
}

// Routed experts read in place: y [B, K, N] = x [B, KX, K'] through expert idx[b, j] (KX = K, or 1: every j reads
// x[b, 0]) of `experts` experts, expert e's weight bytes and scales at ptrs[2e], ptrs[2e + 1], all of one layout (fmt,
// scale_kind, block, [N, K']). The rows of one expert are multiplied together (each weight byte read once per four
// rows); the rows of all the experts go to the threads in one parallel region. Return codes as mhc_qgemv's, and 8
// where an index lies outside [0, experts).
// The jobs of routed experts read in place, for run_jobs: add() takes one set's experts (as mhc_qgemv_experts
// describes), scatter() puts their rows' results where they go. Jobs of one batch whose x rows are the same (w1 and
// w3 of a decode token, every expert of it) share one prepared x.
class ExpertBatch {
  public:
    std::vector<Job> jobs;

    explicit ExpertBatch(int threads) : threads_(threads) {}

    // 0, or 4 out of memory.
    int add(int fmt, const int64_t* ptrs, const int64_t* idx, int scale_kind, const float* x, float* y, int64_t b,
            int64_t kk, int64_t kx, int64_t n, int64_t k, int64_t block, int isa) {
        try {
            return add_set(fmt, ptrs, idx, scale_kind, x, y, b, kk, kx, n, k, block, isa);
        } catch (const std::bad_alloc&) {
            return 4;
        }
    }

    // Jobs of one expert each whose rows of x are gathered already (`xs[i]` [rows, k]: w2's, the experts' own h rows
    // in place of their w1 results; ptrs[i] the expert's weight and scales), their results going to rows `ats[i]` of
    // y [*, n]; the x prepared in parallel. 0, or 4 out of memory.
    int add_gathered(int fmt, const std::vector<const int64_t*>& ptrs, int scale_kind, const std::vector<float*>& xs,
                     const std::vector<std::vector<int64_t>>& ats, float* y, int64_t n, int64_t k, int64_t block,
                     int isa) {
        try {
            const size_t first = jobs.size();
            for (size_t i = 0; i < xs.size(); i++) {
                const int64_t rows = static_cast<int64_t>(ats[i].size());
                parts.push_back(Part{y, n, ats[i], xs[i], {}, Floats(rows * n), false, {}});
                jobs.push_back(make_job(fmt, scale_kind, reinterpret_cast<const void*>(ptrs[i][0]),
                                        reinterpret_cast<const void*>(ptrs[i][1]), xs[i], parts.back().y.data(), rows,
                                        n, k, block, 1));
            }
            const int64_t todo = int64_t(xs.size());
            int oom = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_) if (todo * k >= PARALLEL_VALUES) reduction(| : oom)
            for (int64_t i = 0; i < todo; i++) oom |= prepare_x(jobs[first + i], isa, parts[first + i].own) ? 0 : 1;
            return oom ? 4 : 0;
        } catch (const std::bad_alloc&) {
            return 4;
        }
    }

    // Each job's rows of results where they go (rows in parallel, for a prefill's many).
    void scatter() const {
        std::vector<std::pair<const Part*, int64_t>> rows;
        for (const Part& part : parts)
            for (size_t r = 0; r < part.at.size(); r++) rows.emplace_back(&part, int64_t(r));
        const int64_t count = int64_t(rows.size()), n = parts.empty() ? 0 : parts.front().n;
#pragma omp parallel for schedule(static) num_threads(threads_) if (count * n >= PARALLEL_VALUES)
        for (int64_t i = 0; i < count; i++) {
            const Part& part = *rows[i].first;
            const int64_t r = rows[i].second;
            std::memcpy(part.out + part.at[r] * part.n, part.y.data() + r * part.n, sizeof(float) * part.n);
        }
    }

    struct Part {
        float* out;
        int64_t n;
        std::vector<int64_t> at;    // the rows of out
        const float* src;           // x, and the row of it each of `at` reads
        std::vector<int64_t> from;
        Floats y;
        bool owns_x;                // whether the job prepares its x from src's rows (not an earlier job's, not given)
        XBuf own;
    };
    std::deque<Part> parts;  // one per job (jobs[i]'s: parts[i]); a deque keeps each in place

  private:
    int threads_;

    // One set's experts: each expert's x prepared from its rows where they lie (prepare_x's row map; where no earlier
    // job of the batch prepares the same rows), the experts in parallel (a prefill's).
    int add_set(int fmt, const int64_t* ptrs, const int64_t* idx, int scale_kind, const float* x, float* y, int64_t b,
                int64_t kk, int64_t kx, int64_t n, int64_t k, int64_t block, int isa) {
        std::vector<int64_t> used;  // the experts in order of first use
        std::vector<std::vector<int64_t>> pairs;  // each expert's (b, j) as b * kk + j
        std::unordered_map<int64_t, size_t> slot;
        for (int64_t p = 0; p < b * kk; p++) {
            auto [it, fresh] = slot.emplace(idx[p], used.size());
            if (fresh) used.push_back(idx[p]), pairs.emplace_back();
            pairs[it->second].push_back(p);
        }
        std::vector<size_t> own;  // the new jobs that prepare their own x
        std::vector<std::pair<size_t, size_t>> shared;  // and those that take an earlier job's, once it is prepared
        int64_t values = 0;
        for (size_t e = 0; e < used.size(); e++) {
            const int64_t rows = static_cast<int64_t>(pairs[e].size());
            std::vector<int64_t> from(rows);
            for (int64_t r = 0; r < rows; r++) from[r] = (pairs[e][r] / kk) * kx + (kx > 1 ? pairs[e][r] % kk : 0);
            parts.push_back(Part{y, n, pairs[e], x, std::move(from), Floats(rows * n), false, {}});
            Part& mine = parts.back();
            const int64_t* at = ptrs + 2 * used[e];
            Job j = make_job(fmt, scale_kind, reinterpret_cast<const void*>(at[0]), reinterpret_cast<const void*>(at[1]),
                             x, mine.y.data(), rows, n, k, block, 1);
            if (const size_t o = sharer(j, mine); o < jobs.size()) {
                shared.emplace_back(jobs.size(), o);
            } else {
                mine.owns_x = true, values += rows * k;
                own.push_back(jobs.size());
            }
            jobs.push_back(j);
        }
        const int64_t todo = int64_t(own.size());
        int oom = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_) if (values >= PARALLEL_VALUES) reduction(| : oom)
        for (int64_t i = 0; i < todo; i++)
            oom |= prepare_x(jobs[own[i]], isa, parts[own[i]].own, parts[own[i]].from.data()) ? 0 : 1;
        for (auto [i, o] : shared) {
            Job& j = jobs[i];
            const Job& from = jobs[o];
            if (from.xp && !gemm::scales_take(j)) {  // the panels' pairs need its own scales to qualify too
                oom |= prepare_x(j, isa, parts[i].own, parts[i].from.data()) ? 0 : 1;
                continue;
            }
            j.x = from.x, j.xb = from.xb, j.xi = from.xi, j.xi_scale = from.xi_scale, j.xi_two = from.xi_two;
            j.x_stride = from.x_stride, j.xi_any_two = from.xi_any_two, j.x_exp = from.x_exp, j.panel = from.panel;
            j.f32_fp8 = from.f32_fp8, j.xp = from.xp;
        }
        return oom ? 4 : 0;
    }

    // The earlier job whose x (to be) prepared j can take: the same rows of the same x (w1 and w3 of one expert,
    // experts of one token) in the same layout; jobs.size() where there is none.
    size_t sharer(const Job& j, const Part& mine) const {
        for (size_t i = 0; i < jobs.size(); i++) {
            const Job& o = jobs[i];
            const Part& theirs = parts[i];
            if (o.fmt == j.fmt && o.block == j.block && o.k == j.k && o.m == j.m && o.s_cols == j.s_cols &&
                theirs.owns_x && theirs.src == mine.src && theirs.from == mine.from)
                return i;
        }
        return jobs.size();
    }
};

int mhc_qgemv_experts(int fmt, const int64_t* ptrs, int64_t experts, const int64_t* idx, int scale_kind, const float* x,
                      float* y, int64_t b, int64_t kk, int64_t kx, int64_t n, int64_t k, int64_t block, int isa,
                      int threads) {
    if (int rc = check_args(fmt, block, isa)) return rc;
    if (!in_set(idx, b * kk, experts)) return 8;
    ExpertBatch batch(threads);
    if (batch.add(fmt, ptrs, idx, scale_kind, x, y, b, kk, kx, n, k, block, isa)) return 4;
    const int rc = run_jobs(batch.jobs, isa, threads);
    batch.scatter();
    return rc;
}

// The routed experts of decode rows in one call (mhcrun.model.MoE.routed_gathered over experts read in place): x [t, d]
// rounded to FP8 (blocks of act_block; 0: as given), each row through its k experts idx [t, k] of the sets w1, w3 (ptrs
// [E, 2] each, as mhc_qgemv_experts; [inter, d]), h = weights [t, k] * (silu(min(g, limit)) * clamp(u, -limit, limit))
// (limit > 0; else no clamps) in fp32, as torch's ops compute it but for exp (the C library's, within rounding of
// torch's), h rounded to FP8, through w2 ([d, inter]), and the k results summed in order -> y [t, d]. Each expert's
// rows stay together from w1 to w2 (h in place of its w1 results, w2's x without a gather). Return codes as
// mhc_qgemv_experts' (each set holds `experts` experts), and 1 where a rounding declines (non-finite values: the
// caller takes its torch path).
int mhc_moe_routed(int fmt, const int64_t* ptrs1, const int64_t* ptrs3, const int64_t* ptrs2, int64_t experts,
                   int scale_kind, const int64_t* idx, const float* weights, const float* x, float* y, int64_t t,
                   int64_t k, int64_t d, int64_t inter, int64_t block, float limit, int64_t act_block, int isa,
                   int threads) {
    if (!in_set(idx, t * k, experts)) return 8;
    std::vector<float> xq;
    Floats out;
    try {
        out.resize(t * k * d);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    const float* xin = x;
    if (int rc = round_rows(xin, t, d, act_block, isa, threads, xq)) return rc;
    if (int rc = check_args(fmt, block, isa)) return rc;
    ExpertBatch gate_up(threads);  // w1 and w3 in one parallel region, on one prepared x; each expert's rows alike
    if (gate_up.add(fmt, ptrs1, idx, scale_kind, xin, nullptr, t, k, 1, inter, d, block, isa) ||
        gate_up.add(fmt, ptrs3, idx, scale_kind, xin, nullptr, t, k, 1, inter, d, block, isa))
        return 4;
    if (int rc = run_jobs(gate_up.jobs, isa, threads)) return rc;
    const size_t used = gate_up.jobs.size() / 2;  // the experts in use: w1's jobs, then w3's in the same order
    std::vector<std::pair<size_t, int64_t>> rows;  // (expert, row)
    for (size_t e = 0; e < used; e++)
        for (size_t r = 0; r < gate_up.parts[e].at.size(); r++) rows.emplace_back(e, int64_t(r));
    const int64_t count = int64_t(rows.size());
    // h into each expert's w1 rows, in place: weights * (silu(min(g, limit)) * clamp(u, -limit, limit)) in fp32, as
    // torch's ops compute it but for exp (the C library's)
#pragma omp parallel for schedule(static) num_threads(threads) if (count * inter >= PARALLEL_VALUES)
    for (int64_t i = 0; i < count; i++) {
        auto& g = gate_up.parts[rows[i].first];
        const auto& u = gate_up.parts[used + rows[i].first];
        const int64_t r = rows[i].second;
        const float w = weights[g.at[r]];
        float* gr = g.y.data() + r * inter;
        const float* ur = u.y.data() + r * inter;
        for (int64_t e = 0; e < inter; e++) {
            float a = gr[e], b = ur[e];
            if (limit > 0) a = a > limit ? limit : a, b = b < -limit ? -limit : b > limit ? limit : b;  // NaN kept
            gr[e] = w * ((a / (1.0f + std::exp(-a))) * b);
        }
    }
    std::vector<const int64_t*> p2(used);
    std::vector<float*> hs(used);
    std::vector<std::vector<int64_t>> ats(used);
    for (size_t e = 0; e < used; e++) {
        auto& g = gate_up.parts[e];
        if (act_block > 0 && mhc_act_quant_fp8(g.y.data(), g.y.data(), int64_t(g.at.size()), inter, act_block, isa,
                                               threads))
            return 1;
        p2[e] = ptrs2 + 2 * idx[g.at[0]], hs[e] = g.y.data(), ats[e] = g.at;
    }
    ExpertBatch down(threads);  // w2 of each expert on its own h rows (in w1's order: its routes' order)
    if (down.add_gathered(fmt, p2, scale_kind, hs, ats, out.data(), d, inter, block, isa)) return 4;
    if (int rc = run_jobs(down.jobs, isa, threads)) return rc;
    down.scatter();
#pragma omp parallel for schedule(static) num_threads(threads) if (t * k * d >= PARALLEL_VALUES)
    for (int64_t r = 0; r < t; r++)
        for (int64_t e = 0; e < d; e++) {
            float acc = out[(r * k) * d + e];
            for (int64_t j = 1; j < k; j++) acc += out[(r * k + j) * d + e];
            y[r * d + e] = acc;
        }
    return 0;
}

// MoE.forward of t decode rows on one rank in one call (python: CpuKernel.moe_step): mhc_route (gate [e, d], bias [e]
// or null, hash [t, k] or null, score_func, route_scale), the routed experts' mhc_moe_routed, the shared expert's
// (mhc_moe_routed of its one expert, weighted 1), then their sum -> y [t, d]: the calls of the module's eager path in
// its order, and its sum, so the same values. sets: int64 [2, 8], the routed experts then the shared one: [the
// addresses of the sets w1, w3, w2 (each [experts, 2] as mhc_qgemv_experts'), format, scale kind, experts, inter,
// block]; act_*: their activation blocks. Codes as those calls', 4 out of memory.
int mhc_moe_step(const float* x, const float* gate, const float* bias, const int64_t* hash, int64_t e, int64_t k,
                 int score_func, float route_scale, const int64_t* sets, int64_t act_routed, int64_t act_shared,
                 float limit, float* y, int64_t t, int64_t d, int isa, int threads) {
    std::vector<float> weights, ys, ones;
    std::vector<int64_t> idx, zeros;
    try {
        weights.resize(t * k), idx.resize(t * k), ys.resize(t * d), ones.assign(t, 1.0f), zeros.assign(t, 0);
    } catch (const std::bad_alloc&) {
        return 4;
    }
    if (int rc = mhc_route(x, gate, bias, hash, weights.data(), idx.data(), t, d, e, k, score_func, route_scale,
                           std::min(isa, 2), threads))  // the isa CpuKernel.route gives it
        return rc;
    const auto set = [](int64_t at) { return reinterpret_cast<const int64_t*>(at); };
    const int64_t *r = sets, *sh = sets + 8;
    if (int rc = mhc_moe_routed(int(r[3]), set(r[0]), set(r[1]), set(r[2]), r[5], int(r[4]), idx.data(),
                                weights.data(), x, y, t, k, d, r[6], r[7], limit, act_routed, isa, threads))
        return rc;
    if (int rc = mhc_moe_routed(int(sh[3]), set(sh[0]), set(sh[1]), set(sh[2]), sh[5], int(sh[4]), zeros.data(),
                                ones.data(), x, ys.data(), t, 1, d, sh[6], sh[7], limit, act_shared, isa, threads))
        return rc;
    for (int64_t i = 0; i < t * d; i++) y[i] += ys[i];
    return 0;
}

// Block.ffn_half of decode rows in one call (python: CpuKernel.ffn_half): mhc_hc_post_pre (its arguments), then
// mhc_moe_step (its arguments; its x the h the first writes), as the block's eager calls make them. Their codes.
int mhc_ffn_half(int bf16, const void* y, const void* res, const float* post, const float* comb, void* x_new,
                 const float* fn, const float* scale, const float* base, const float* weight, void* h, float* post_out,
                 float* comb_out, int64_t t, int64_t n, int64_t d, int64_t iters, float eps, float norm_eps,
                 float* work, int isa, int threads, const float* x, const float* gate, const float* bias,
                 const int64_t* hash, int64_t e, int64_t k, int score_func, float route_scale, const int64_t* sets,
                 int64_t act_routed, int64_t act_shared, float limit, float* out, int64_t rows, int64_t dim,
                 int moe_isa, int moe_threads) {
    if (int rc = mhc_hc_post_pre(bf16, y, res, post, comb, x_new, fn, scale, base, weight, h, post_out, comb_out, t, n,
                                 d, iters, eps, norm_eps, work, isa, threads))
        return rc;
    return mhc_moe_step(x, gate, bias, hash, e, k, score_func, route_scale, sets, act_routed, act_shared, limit, out,
                        rows, dim, moe_isa, moe_threads);
}

// DeepSeek's activation quantisation as simulated by mhcrun.ops.quant.fp8_simulate(x, block, pow2_scale=True),
// fp32 rows x [rows, k] -> y (x itself allowed), rows split over `threads` threads, in AVX-512 where `isa` is 2 or 3
// (act_quant_block), in AVX2 where it is 1 (act_quant_block_avx2; scalar for the last len % 8 values of a block; 12
// -> ~2 us for a decode row of 2,048 on a Zen 3 VM), the same operations all: per block of `block` values (the
// last may be partial), scale = the smallest power of two >= max(amax, 1e-4) / 448, and each value becomes
// e4m3(value / scale) * scale, rounded to nearest even (fp8_scale, e4m3_round: bitwise torch's). Returns 1, writing
// nothing, when x holds a non-finite value (torch's NaN/inf rules then apply, on the torch path), or when a thread
// flushes subnormals (a subnormal x would then round otherwise than torch rounds it); 3 for an isa this CPU lacks.
int mhc_act_quant_fp8(const float* x, float* y, int64_t rows, int64_t k, int64_t block, int isa, int threads) {
    if (rows < threads) threads = rows > 0 ? static_cast<int>(rows) : 1;  // decode's row or two: no idle thread
    if (isa < 1 || isa > mhc_qgemv_isa()) return 3;
    int bad = 0;
    const unsigned caller = _mm_getcsr();
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : bad)
    for (int64_t r = 0; r < rows; r++) {
        bad |= take_caller_mode(caller);
        bad |= (isa >= 2 ? all_finite(x + r * k, k) : all_finite_avx2(x + r * k, k)) ? 0 : 1;
    }
    if (bad) return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k0 = 0; k0 < k; k0 += block) {
            const float* v = x + r * k + k0;
            float* out = y + r * k + k0;
            const int64_t len = k0 + block < k ? block : k - k0;
            if (isa >= 2) act_quant_block(v, out, len);
            else act_quant_block_avx2(v, out, len);
        }
    }
    return 0;
}

// fp4_simulate's rounding of fp32 rows x [rows, k] in blocks of `block` (see mhc_fp4_simulate), written as the rounded
// values into out (x itself allowed) and/or as kvcache's fp4 entries (packed codes, block scales). 1, writing nothing,
// for a non-finite x or a thread that flushes subnormals.
static int fp4_blocks(const float* x, int64_t rows, int64_t k, int64_t block, float* out, uint8_t* packed,
                      float* scales, int threads) {
    if (flushes_denormals()) return 1;
    for (int64_t i = 0; i < rows * k; i++)
        if (!std::isfinite(x[i])) return 1;
    const int64_t sb = (k + block - 1) / block;
    const unsigned caller = _mm_getcsr();
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * k >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        take_caller_mode(caller);  // the caller does not flush (above)
        for (int64_t k0 = 0, g = 0; k0 < k; k0 += block, g++) {
            const float* v = x + r * k + k0;
            const int64_t len = k0 + block < k ? block : k - k0;
            const Pow2Scale sc = pow2_scale(v, len, 6.0f * 0x1p-126f, 6.0f);
            if (scales) scales[r * sb + g] = sc.scale;
            for (int64_t i = 0; i < len; i++) {
                const float q = std::fmin(std::fmax(v[i] * sc.inv, -6.0f), 6.0f);
                const float a = std::fabs(q);
                const float step = a < 2.0f ? 0.5f : a < 4.0f ? 1.0f : 2.0f;
                const float t = a / step;  // exact: a power of two
                const float rounded = std::fmin(((t + 0x1p23f) - 0x1p23f) * step, 6.0f);  // half to even
                if (out) out[r * k + k0 + i] = std::copysign(rounded, q) * sc.scale;
                if (packed) {  // the grid index of the magnitude: 2a on [0, 2), a + 2 on [2, 4), a / 2 + 4 on [4, 6]
                    const int grid = int(rounded < 2.0f ? rounded * 2.0f : rounded < 4.0f ? rounded + 2.0f
                                                                                          : rounded * 0.5f + 4.0f);
                    const int code = grid | (std::signbit(q) ? 8 : 0);
                    uint8_t& byte = packed[(r * k + k0 + i) / 2];
                    byte = (k0 + i) % 2 ? uint8_t((byte & 0x0F) | (code << 4)) : uint8_t(code);
                }
            }
        }
    }
    return 0;
}

// mhcrun.ops.quant.fp4_simulate(x, block) in place on fp32 rows [rows, k], bitwise: per block of `block` values (the
// last may be partial), scale = pow2_ceil(max(amax, 6 * 2**-126) / 6) (a normal power of two: the one division
// rounds as torch's), q = x / scale (as x times the inverse: the same correctly rounded product), rounded to the
// e2m1 grid with ties to the even mantissa (round_e2m1: half-to-even on the binade's step, saturating at 6, the
// sign kept, -0.0 included), times the scale (exact); a prefill's many rows split over `threads` threads. Returns 1,
// leaving x as it was, when x holds a non-finite value or the thread flushes subnormals (the caller then takes torch's
// path).
int mhc_fp4_simulate(float* x, int64_t rows, int64_t k, int64_t block, int threads) {
    return fp4_blocks(x, rows, k, block, x, nullptr, nullptr, threads);
}

// mhcrun.ops.kvcache.encode of the fp4 format (indexer keys), bitwise: each row of x [rows, k] (k even) -> its e2m1
// codes packed [rows, k / 2] (low nibble first; the code's sign that of the rounded value, -0.0 included) and block
// scales [rows, ceil(k / block)] fp32, as quantize_act_fp4 gives them (fp4_simulate's rounding). Returns 1, writing
// nothing, when x holds a non-finite value or the thread flushes subnormals (the caller then takes torch's path).
int mhc_kv_fp4_encode(const float* x, uint8_t* packed, float* scales, int64_t rows, int64_t k, int64_t block) {
    if (k % 2) return 6;
    return fp4_blocks(x, rows, k, block, nullptr, packed, scales, 1);
}

// mhcrun.ops.kvcache.encode of the fp8 format (pow2 scales) in fp32, bitwise: each row of x [rows, nope + rd] ->
// its e4m3 codes [rows, nope] and block scales [rows, ceil(nope / block)] as quantize_act_fp8(x, block) gives them
// (fp8_scale, e4m3_round: mhc_act_quant_fp8's rounding, the rounded value / scale written as its code), and its rope
// channels copied to rope [rows, rd]. Returns 1, writing nothing, when x holds a non-finite value or a thread flushes
// subnormals (the caller then takes torch's path).
int mhc_kv_fp8_encode(const float* x, uint8_t* codes, float* scales, float* rope, int64_t rows, int64_t nope,
                      int64_t block, int64_t rd) {
    const int64_t width = nope + rd, sb = (nope + block - 1) / block;
    if (flushes_denormals()) return 1;
    for (int64_t i = 0; i < rows * width; i++)
        if (!std::isfinite(x[i])) return 1;
    for (int64_t r = 0; r < rows; r++)
        encode_fp8_entry(x + r * width, codes + r * nope, scales + r * sb, rope + r * rd, nope, block, rd);
    return 0;
}

// Rows [r0, r1) of an fp8 or fp4 weight [N, K] dequantised into out [r1 - r0, K] fp32: each value times its
// scale, one fp32 multiply, bitwise equal to mhcrun.ops.quant.dequantize_fp8 / dequantize_fp4 (e4m3 NaN codes give
// NaN). The torch chunk decoders of qlinear take ~9 passes over a chunk; this is one. For the prefill GEMMs
// (more rows of x than mhc_qgemv takes), which multiply the rows right after. Returns 5 when this thread
// flushes subnormals (they are part of the formats), else 0.
int mhc_decode_rows(int fmt, const void* w, const void* s, int scale_kind, float* out, int64_t r0, int64_t r1,
                    int64_t n, int64_t k, int64_t block, int isa, int threads) {
    if (isa < 0 || isa > mhc_qgemv_isa()) return 3;
    const Job j = make_job(fmt, scale_kind, w, s, nullptr, nullptr, 0, n, k, block, 1);
    const uint8_t* bytes = j.w;
    const int64_t row_bytes = j.row_bytes;
    int flush = 0;
    const unsigned caller = _mm_getcsr();
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : flush)
    for (int64_t r = r0; r < r1; r++) {
        flush |= take_caller_mode(caller);
        const uint8_t* src = bytes + r * row_bytes;
        float* dst = out + (r - r0) * k;
        const int64_t srow = fmt == FMT_FP8 ? r / block : r;
        for (int64_t c0 = 0, c = 0; c0 < k; c0 += block, c++) {
            const int64_t c1 = c0 + block < k ? c0 + block : k;
            decode_block(fmt, isa, src, dst, c0, c1, scale_at(j, srow, c));
        }
    }
    return flush & 2 ? 4 : flush ? 5 : 0;
}

}  // extern "C"

// A step run in one parallel region (see "a decode step in one parallel region" above): fn() on the calling thread,
// which keeps it, and `threads` - 1 workers joining its loops and reading ahead. A scope (mhc_scope_new) keeps what
// each call was followed by from step to step, and reads those weights: free it (mhc_scope_free) before they go.
// Where the calling thread already runs a step, or gets no worker, fn() runs as it is. Returns 0.
extern "C" void* mhc_scope_new(void) { return new (std::nothrow) StepScope(); }

extern "C" void mhc_scope_free(void* scope) { delete static_cast<StepScope*>(scope); }

// The bytes a scope's steps have read ahead, in all.
extern "C" int64_t mhc_scope_read_ahead(void* scope) { return static_cast<StepScope*>(scope)->read.load(); }

extern "C" int mhc_run_step(void* scope, void (*fn)(void), int threads) {
    StepScope* sc = static_cast<StepScope*>(scope);
    if (sc == nullptr || step_scope != nullptr || threads < 2) {
        fn();
        return 0;
    }
    sc->stop.store(false);
#pragma omp parallel num_threads(threads)
    {
        if (omp_get_thread_num() == 0) {
            step_scope = omp_get_num_threads() > 1 ? sc : nullptr;
            // the step's other parallel regions (the graphs' kernels, torch's) run on this thread alone: nested, they
            // would start threads of their own beside the workers, more threads than cores
            const int levels = omp_get_max_active_levels();
            omp_set_max_active_levels(1);
            fn();
            omp_set_max_active_levels(levels);
            step_scope = nullptr;
            sc->stop.store(true, std::memory_order_release);
        } else {
            serve(*sc, omp_get_thread_num() == 1);
        }
    }
    return 0;
}
