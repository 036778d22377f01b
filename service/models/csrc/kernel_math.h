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

#endif
