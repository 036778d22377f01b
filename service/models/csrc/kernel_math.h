/* Scalar helpers the kernel files share: bf16 <-> float32, a vectorizable exp, cache prefetch. */
#ifndef ZEROGAP_KERNEL_MATH_H
#define ZEROGAP_KERNEL_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Prefetch every cache line of bytes [p, p + n): a pool row's head slice spans several lines
 * (64 float32s: 4), and the rows of a request lie scattered in the pool, where no hardware
 * prefetcher follows them. */
static inline void prefetch_span(const void *p, int64_t n) {
    for (int64_t b = 0; b < n; b += 64) __builtin_prefetch((const char *)p + b);
}

/* The same into L2 only (prefetcht1): for rows fetched far ahead, which in L1 would crowd out what
 * the loop reads now. */
static inline void prefetch_span_l2(const void *p, int64_t n) {
    for (int64_t b = 0; b < n; b += 64) __builtin_prefetch((const char *)p + b, 0, 2);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* NaN stays NaN */
    x += 0x7fffu + ((x >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(x >> 16);
}

/* exp(x), vectorizable (no libm call): 2^(x log2 e) split into 2^n * 2^f,
 * f in [-0.5, 0.5], with a degree-6 polynomial (relative error ~2e-7, a few
 * float ulps). Below -87 it returns 0; above EXP_MAX_ARG infinity, as expf (between 88 and it
 * ~2^127). */
#define EXP_MAX_ARG 88.72283935546875f /* above it expf overflows to infinity (so silu(x) -> -0 below -EXP_MAX_ARG) */
static inline float exp_approx(float x) {
    float t = x * 1.44269504088896341f;
    t = t < -126.f ? -126.f : (t > 127.f ? 127.f : t);
    const float n = (t + 12582912.f) - 12582912.f; /* round to nearest: 1.5 * 2^23 trick, vectorizes */
    const float f = t - n;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.f ? 0.f : (x > EXP_MAX_ARG ? INFINITY : p * scale);
}

/* silu(x) = x * sigmoid(x), with exp_approx. */
static inline float silu_f32(float x) { return x / (1.f + exp_approx(-x)); }

#if defined(__AVX512F__)
#include <immintrin.h>

/* 2^t for t <= 0, 16 lanes (a softmax weight): exp_approx's split into 2^n * 2^f, f in [-0.5,
 * 0.5], and its polynomial (fused here); t below -150 (a key the row must not see: -inf) gives
 * exactly 0, as 2^-150 rounds to 0. */
static inline __m512 exp2_nonpositive16(__m512 t) {
    t = _mm512_max_ps(_mm512_set1_ps(-150.f), t);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* Query heads a bf16 row item of paged_attention holds at most (AVX-512 BF16, d 64 or 128): the
 * shapes whose rows weigh with bf16_softmax_block in both kernels. */
#define BF16_ROW_MAX_HQ 32

#if defined(__AVX512BF16__)
/* Softmax weights rounded to bf16, for P.V on bf16 weights (vdpbf16ps), one block of n <= 64
 * scaled scores at a time (online): x = s * k in log2 units (k = log2 e). The running max m is
 * kept a whole number N >= every x so far, so that a weight 2^(x - N) is the polynomial of x's
 * fraction times an exact power of two: its bf16 rounding does not follow the blocks before it
 * (where N is far above x, x - N rounds, and the weight is tiny), and the accumulators' factor
 * 2^(N_old - N) is exact. The paged kernel's row items and the extend kernel both weigh with it,
 * so a row rounds the same weights in either whatever the chunk, batch or window, but where the
 * kernels' float32 dot products (summed in other orders) fall on either side of a rounding: rarely
 * (tests/models/test_cpu_speed_paths.py). Weights below 2^-126 are 0 (vcvtneps2bf16 flushes them).
 * s[0..n) -> the weights (float32 values of bf16 numbers), l += their sum; returns the
 * accumulators' factor (0 on the first block). */
static inline float bf16_softmax_block(float *s, int64_t n, float k, float *m, float *l) {
    const __m512 vk = _mm512_set1_ps(k), ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx = ninf;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
        mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_mask_loadu_ps(ninf, live, s + j), vk));
    }
    const float block_max = _mm512_reduce_max_ps(mx);
    const float top = block_max > *m ? ceilf(block_max) : *m;
    if (top == -INFINITY) { /* no key seen yet: nothing weighs */
        memset(s, 0, n * sizeof(float));
        return 1.f;
    }
    const float drop = *m - top; /* whole, <= 0; -inf on the first block; NaN if a score was +inf */
    const float corr = drop >= -160.f ? ldexpf(1.f, (int)drop) : 0.f;
    const __m512 vtop = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
        __m512 p = exp2_nonpositive16(_mm512_sub_ps(_mm512_mul_ps(_mm512_mask_loadu_ps(ninf, live, s + j), vk), vtop));
        p = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p)), 16));
        p = _mm512_maskz_mov_ps(live, p);
        _mm512_mask_storeu_ps(s + j, live, p);
        sum = _mm512_add_ps(sum, p);
    }
    *m = top;
    *l = *l * corr + _mm512_reduce_add_ps(sum);
    return corr;
}
#endif

#endif
