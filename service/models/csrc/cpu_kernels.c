/* Paged attention on CPU, reading the KV pool in place (no gather).
 *
 * Layouts (all contiguous):
 *   q        [n_q, hq, d]         query rows (one per token)
 *   k, v     [pool, hkv, d]       the layer's KV pool
 *   table    [bs, table_stride]   pool row of each request's kv position
 *   out      [n_q, hq, d]
 * Query row i belongs to request req_of[i] and sits at absolute position
 * pos_of[i]; it attends to kv positions max(0, pos-window+1) .. pos (causal;
 * window <= 0: no window). Decode is the case of one query row per request.
 * softcap > 0 caps the scores, softcap * tanh(scores / softcap) (Gemma-2),
 * before the softmax; 0: uncapped.
 *
 * Many query rows (4 per thread of the engine's team, or more): one work item
 * per query row, all heads (bf16 with AVX-512 BF16: bf16_rows_attention; else
 * the generic item over every kv head, unless an AVX-512 (row, head) item fits).
 * Otherwise work items are (query row, kv head): the g = hq / hkv query heads of
 * a group share each K/V row load. Which items run never changes a row's bits
 * (each path is one function for both item kinds): a row's attention does not
 * depend on the batch it runs in. Scores are computed block by block with an
 * online softmax in float32 (the bf16 row items round the weights to bf16, as the
 * extend kernel does). Element type: bf16 (uint16 bits) or float32.
 * OpenMP threads come from the runtime torch already loaded (libgomp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

#define BLOCK 256
#define MAX_D 256
#define MAX_G 16
#define PREFETCH 8 /* rows ahead: the pool rows of a request are scattered */
#define ITEM_HEADS 32    /* query heads of one work item at most (a row item: hq) */
#define ITEM_FLOATS 4096 /* query heads x d of one work item at most (MAX_G * MAX_D) */

/* One block of an online softmax: scores s[0..n) -> exp(s - new max) in place; the running max
 * m and sum l move to the new max. Returns the factor the accumulators must be scaled by
 * (0 on the first block, where m was -inf). */
static inline float online_softmax_block(float *s, int64_t n, float *m, float *l) {
    float bm = *m;
    for (int64_t j = 0; j < n; j++) bm = s[j] > bm ? s[j] : bm;
    const float corr = exp_approx(*m - bm);
    float sum = 0.f;
    _Pragma("omp simd reduction(+ : sum)")
    for (int64_t j = 0; j < n; j++) { s[j] = exp_approx(s[j] - bm); sum += s[j]; }
    *m = bm;
    *l = *l * corr + sum;
    return corr;
}

/* Soft-capped scores (Gemma-2): s = tanh(s / cap) * cap in place, transformers' op order. */
static inline void cap_scores(float *s, int64_t n, float cap) {
    for (int64_t j = 0; j < n; j++) s[j] = tanhf(s[j] / cap) * cap;
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

#if defined(__AVX512F__)
#include <immintrin.h>
/* AVX-512 item functions for the common shapes (head_dim 64/128, group 1-4 or 8): the group's
 * query heads and accumulators live in registers; a K/V row is converted to float once per
 * token and used by every head of the group. Same math as the generic item function. */
#define LOADV_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define LOADV_F32(p) _mm512_loadu_ps(p)

#define DEFINE_AVX512_ITEM(NAME, T, LOADV, STORE, G, DV)                                                    \
    static void NAME(const T *q, int64_t q_stride, const T *k, const T *v, const int64_t *rows,            \
                     int64_t start, int64_t pos, int64_t i, int64_t h, int64_t hq, int64_t hkv, float scale, \
                     float softcap, T *out) {                                                               \
        const int64_t d = DV * 16;                                                                          \
        __m512 qv[G][DV], acc[G][DV];                                                                       \
        float m[G], l[G], s[G][BLOCK];                                                                      \
        for (int a = 0; a < G; a++) {                                                                       \
            const T *qa = q + i * q_stride + (h * G + a) * d;                                               \
            for (int x = 0; x < DV; x++) {                                                                  \
                qv[a][x] = _mm512_mul_ps(LOADV(qa + 16 * x), _mm512_set1_ps(scale));                        \
                acc[a][x] = _mm512_setzero_ps();                                                            \
            }                                                                                               \
            m[a] = -INFINITY;                                                                               \
            l[a] = 0.f;                                                                                     \
        }                                                                                                   \
        for (int64_t j0 = start; j0 <= pos; j0 += BLOCK) {                                                  \
            const int64_t n = (pos + 1 - j0) < BLOCK ? (pos + 1 - j0) : BLOCK;                              \
            for (int64_t j = 0; j < n; j++) {                                                               \
                if (j + PREFETCH < n) {                                                                     \
                    __builtin_prefetch(k + (rows[j0 + j + PREFETCH] * hkv + h) * d);                        \
                    __builtin_prefetch(v + (rows[j0 + j + PREFETCH] * hkv + h) * d);                        \
                }                                                                                           \
                const T *kr = k + (rows[j0 + j] * hkv + h) * d;                                             \
                __m512 kv[DV];                                                                              \
                for (int x = 0; x < DV; x++) kv[x] = LOADV(kr + 16 * x);                                    \
                for (int a = 0; a < G; a++) {                                                               \
                    __m512 t = _mm512_mul_ps(qv[a][0], kv[0]);                                              \
                    for (int x = 1; x < DV; x++) t = _mm512_fmadd_ps(qv[a][x], kv[x], t);                   \
                    s[a][j] = _mm512_reduce_add_ps(t);                                                      \
                }                                                                                           \
            }                                                                                               \
            for (int a = 0; a < G; a++) {                                                                   \
                if (softcap > 0.f) cap_scores(s[a], n, softcap);                                            \
                const __m512 corr = _mm512_set1_ps(online_softmax_block(s[a], n, &m[a], &l[a]));            \
                for (int x = 0; x < DV; x++) acc[a][x] = _mm512_mul_ps(acc[a][x], corr);                    \
            }                                                                                               \
            for (int64_t j = 0; j < n; j++) {                                                               \
                const T *vr = v + (rows[j0 + j] * hkv + h) * d;                                             \
                __m512 vv[DV];                                                                              \
                for (int x = 0; x < DV; x++) vv[x] = LOADV(vr + 16 * x);                                    \
                for (int a = 0; a < G; a++) {                                                               \
                    const __m512 p = _mm512_set1_ps(s[a][j]);                                               \
                    for (int x = 0; x < DV; x++) acc[a][x] = _mm512_fmadd_ps(p, vv[x], acc[a][x]);          \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int a = 0; a < G; a++) {                                                                       \
            T *o = out + (i * hq + h * G + a) * d;                                                          \
            const __m512 inv = _mm512_set1_ps(1.f / l[a]);                                                  \
            float tmp[16];                                                                                  \
            for (int x = 0; x < DV; x++) {                                                                  \
                _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[a][x], inv));                                       \
                for (int e = 0; e < 16; e++) o[16 * x + e] = STORE(tmp[e]);                                 \
            }                                                                                               \
        }                                                                                                   \
    }

#define DEFINE_AVX512_ITEMS(PREFIX, T, LOADV, STORE)                                                        \
    DEFINE_AVX512_ITEM(PREFIX##_g1_d64, T, LOADV, STORE, 1, 4)                                              \
    DEFINE_AVX512_ITEM(PREFIX##_g2_d64, T, LOADV, STORE, 2, 4)                                              \
    DEFINE_AVX512_ITEM(PREFIX##_g3_d64, T, LOADV, STORE, 3, 4)                                              \
    DEFINE_AVX512_ITEM(PREFIX##_g4_d64, T, LOADV, STORE, 4, 4)                                              \
    DEFINE_AVX512_ITEM(PREFIX##_g8_d64, T, LOADV, STORE, 8, 4)                                              \
    DEFINE_AVX512_ITEM(PREFIX##_g1_d128, T, LOADV, STORE, 1, 8)                                             \
    DEFINE_AVX512_ITEM(PREFIX##_g2_d128, T, LOADV, STORE, 2, 8)                                             \
    DEFINE_AVX512_ITEM(PREFIX##_g3_d128, T, LOADV, STORE, 3, 8)                                             \
    DEFINE_AVX512_ITEM(PREFIX##_g4_d128, T, LOADV, STORE, 4, 8)                                             \
    DEFINE_AVX512_ITEM(PREFIX##_g8_d128, T, LOADV, STORE, 8, 8)

/* 1 if a specialised item function ran. */
#define AVX512_DISPATCH(PREFIX)                                                                             \
    static int PREFIX##_dispatch(const void *q, int64_t q_stride, const void *k, const void *v,            \
                                 const int64_t *rows, int64_t start, int64_t pos, int64_t i, int64_t h,     \
                                 int64_t hq, int64_t hkv, int64_t g, int64_t d, float scale, float softcap, \
                                 void *out) {                                                               \
        _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wincompatible-pointer-types\"")   \
        switch (d * 16 + g) {                                                                               \
            case 64 * 16 + 1: PREFIX##_g1_d64(q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, scale, softcap, out); return 1; \
            case 64 * 16 + 2: PREFIX##_g2_d64(q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, scale, softcap, out); return 1; \
            case 64 * 16 + 3: PREFIX##_g3_d64(q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, scale, softcap, out); return 1; \
            case 64 * 16 + 4: PREFIX##_g4_d64(q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, scale, softcap, out); return 1; \
            case 64 * 16 + 8: PREFIX##_g8_d64(q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, scale, softcap, out); return 1; \
            case 128 * 16 + 1: PREFIX##_g1_d128(q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, scale, softcap, out); return 1; \
            case 128 * 16 + 2: PREFIX##_g2_d128(q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, scale, softcap, out); return 1; \
            case 128 * 16 + 3: PREFIX##_g3_d128(q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, scale, softcap, out); return 1; \
            case 128 * 16 + 4: PREFIX##_g4_d128(q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, scale, softcap, out); return 1; \
            case 128 * 16 + 8: PREFIX##_g8_d128(q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, scale, softcap, out); return 1; \
        }                                                                                                   \
        _Pragma("GCC diagnostic pop")                                                                       \
        return 0;                                                                                           \
    }

DEFINE_AVX512_ITEMS(avx512_bf16, uint16_t, LOADV_BF16, f32_to_bf16)
DEFINE_AVX512_ITEMS(avx512_f32, float, LOADV_F32, LOAD_F32)
AVX512_DISPATCH(avx512_bf16)
AVX512_DISPATCH(avx512_f32)
#define AVX512_ITEM(PREFIX, ...) PREFIX##_dispatch(__VA_ARGS__)
/* The shapes PREFIX##_dispatch has an item for (its switch cases): keep the two in step. */
#define AVX512_HAS(d, g) (((d) == 64 || (d) == 128) && ((g) <= 4 || (g) == 8))
#else
#define AVX512_ITEM(PREFIX, ...) 0
#define AVX512_HAS(d, g) 0
#endif


#if defined(__AVX512BF16__)
/* Decode-shaped bf16 path (AVX-512 BF16): one work item per query row, all its heads (with
 * fewer rows than row_min: per query row and kv head, the same function on one head's range).
 * A token's K (and V) row for every kv head is one contiguous run of hkv * d values, read
 * once (prefetched whole into L2, PF_ROWS tokens ahead: the rows of a request's decoded
 * tokens lie far apart in the pool, and a request's K and V outgrow the caches, 30 layers of
 * 1,000 tokens being 46 MB in SmolLM2); q.k runs on bf16 pairs (vdpbf16ps, float32 sums) and 16 tokens'
 * partial sums are reduced together (one transpose-add tree, not 16 horizontal sums).
 * The weights are rounded to bf16 (`bf16_softmax_block`, as the extend kernel's on AVX-512 BF16,
 * so a row nearly always gets the same weights from either), P.V is float32. Taken when d is 64 or 128
 * and the heads fit the item's buffers (ROW_MAX_HQ); else the (row, kv head) items below run. */
#define ROW_BLOCK 64
#define ROW_MAX_HQ BF16_ROW_MAX_HQ
/* 32 tokens ahead into L2: 3 decode rows over 1,000 keys, 30 layers whose pools outgrow the caches,
 * one Zen 4 thread: 9.3 ms a step with 16 ahead into L1, 6.3 with 32 into L2 (64: 6.2, 128: 6.9;
 * 32 into L1: 9.0). Into L1 that far, the prefetches crowd out the item's own buffers and misses. */
#define PF_ROWS 32

/* r[t] = sum of the 16 lanes of v[t], t < 16. */
static inline __m512 reduce16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int t = 0; t < 8; t++)
        a[t] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * t], v[2 * t + 1]), _mm512_unpackhi_ps(v[2 * t], v[2 * t + 1]));
    for (int t = 0; t < 4; t++)
        b[t] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[2 * t]), _mm512_castps_pd(a[2 * t + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[2 * t]), _mm512_castps_pd(a[2 * t + 1]))));
    for (int t = 0; t < 2; t++)
        c[t] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * t], b[2 * t + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * t], b[2 * t + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}



/* P.V for NH heads (a0 ..) of kv head h over the block's n tokens; their accumulators stay in
 * registers for the block (NH * D / 16 <= 16 of them). */
#define PV_PASS(NH)                                                                                         \
    do {                                                                                                    \
        __m512 ac[NH][D / 16];                                                                              \
        for (int b = 0; b < NH; b++)                                                                        \
            for (int x = 0; x < D / 16; x++) ac[b][x] = _mm512_loadu_ps(&acc[a0 + b][16 * x]);              \
        for (int64_t t = 0; t < n; t++) {                                                                   \
            const uint16_t *vr = v + rows[j0 + t] * row_elems + h * D;                                      \
            __m512 vf[D / 16];                                                                              \
            for (int x = 0; x < D / 16; x++) vf[x] = LOADV_BF16(vr + 16 * x);                               \
            for (int b = 0; b < NH; b++) {                                                                  \
                const __m512 p = _mm512_set1_ps(s[a0 + b][t]);                                              \
                for (int x = 0; x < D / 16; x++) ac[b][x] = _mm512_fmadd_ps(p, vf[x], ac[b][x]);            \
            }                                                                                               \
        }                                                                                                   \
        for (int b = 0; b < NH; b++)                                                                        \
            for (int x = 0; x < D / 16; x++) _mm512_storeu_ps(&acc[a0 + b][16 * x], ac[b][x]);              \
    } while (0)

#define DEFINE_ROW_ITEM(NAME, DV)                                                                             \
    static __attribute__((noinline)) void NAME(                                                            \
        const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *rows, int64_t start,         \
        int64_t pos, int64_t h0, int64_t h1, int64_t hq, int64_t hkv, float scale, float softcap,            \
        uint16_t *out) {                                                                                    \
        enum { D = DV * 32, PV_HEADS = DV == 2 ? 4 : 2 };                                                \
        const int64_t g = hq / hkv, row_elems = hkv * D;                                                    \
        __m512bh qv[ROW_MAX_HQ][DV];                                                                        \
        __m512 part[ROW_MAX_HQ][16];                                                                        \
        float acc[ROW_MAX_HQ][D], m[ROW_MAX_HQ], l[ROW_MAX_HQ], s[ROW_MAX_HQ][ROW_BLOCK];                \
        for (int64_t a = h0 * g; a < h1 * g; a++) {                                                         \
            for (int x = 0; x < DV; x++) qv[a][x] = (__m512bh)_mm512_loadu_si512(q + a * D + 32 * x);      \
            for (int t = 0; t < 16; t++) part[a][t] = _mm512_setzero_ps();                                  \
            for (int e = 0; e < D; e++) acc[a][e] = 0.f;                                                    \
            m[a] = -INFINITY;                                                                               \
            l[a] = 0.f;                                                                                     \
        }                                                                                                   \
        const __m512 vscale = _mm512_set1_ps(scale);                                                        \
        for (int64_t j0 = start; j0 <= pos; j0 += ROW_BLOCK) {                                              \
            const int64_t n = (pos + 1 - j0) < ROW_BLOCK ? (pos + 1 - j0) : ROW_BLOCK;                      \
            for (int64_t jb = 0; jb < n; jb += 16) {                                                        \
                const int64_t nn = (n - jb) < 16 ? (n - jb) : 16;                                           \
                for (int64_t t = 0; t < nn; t++) {                                                          \
                    const int64_t j = j0 + jb + t;                                                          \
                    if (j + PF_ROWS <= pos) {                                                               \
                        prefetch_span_l2(k + rows[j + PF_ROWS] * row_elems + h0 * D, (h1 - h0) * D * sizeof(uint16_t)); \
                        prefetch_span_l2(v + rows[j + PF_ROWS] * row_elems + h0 * D, (h1 - h0) * D * sizeof(uint16_t)); \
                    }                                                                                       \
                    const uint16_t *kr = k + rows[j] * row_elems;                                           \
                    for (int64_t h = h0; h < h1; h++) {                                                     \
                        __m512bh kv[DV];                                                                    \
                        for (int x = 0; x < DV; x++) kv[x] = (__m512bh)_mm512_loadu_si512(kr + h * D + 32 * x); \
                        for (int64_t a = h * g; a < (h + 1) * g; a++) {                                     \
                            __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[a][0], kv[0]);            \
                            for (int x = 1; x < DV; x++) dot = _mm512_dpbf16_ps(dot, qv[a][x], kv[x]);      \
                            part[a][t] = dot;                                                               \
                        }                                                                                   \
                    }                                                                                       \
                }                                                                                           \
                for (int64_t a = h0 * g; a < h1 * g; a++) {                                                 \
                    float tmp[16];                                                                          \
                    _mm512_storeu_ps(tmp, _mm512_mul_ps(reduce16(part[a]), vscale));                       \
                    memcpy(&s[a][jb], tmp, nn * sizeof(float));                                             \
                }                                                                                           \
            }                                                                                               \
            for (int64_t a = h0 * g; a < h1 * g; a++) {                                                     \
                if (softcap > 0.f) cap_scores(s[a], n, softcap);                                            \
                const __m512 corr = _mm512_set1_ps(bf16_softmax_block(s[a], n, 1.44269504088896341f, &m[a], &l[a])); \
                for (int x = 0; x < D / 16; x++)                                                            \
                    _mm512_storeu_ps(&acc[a][16 * x], _mm512_mul_ps(_mm512_loadu_ps(&acc[a][16 * x]), corr)); \
            }                                                                                               \
            for (int64_t h = h0; h < h1; h++) {                                                             \
                for (int64_t a0 = h * g; a0 < (h + 1) * g; a0 += PV_HEADS) {                                \
                    const int64_t nh = (h + 1) * g - a0 < PV_HEADS ? (h + 1) * g - a0 : PV_HEADS;          \
                    switch (nh) {                                                                           \
                        case 1: PV_PASS(1); break;                                                          \
                        case 2: PV_PASS(2); break;                                                          \
                        case 3: PV_PASS(3); break;                                                          \
                        default: PV_PASS(4); break;                                                         \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int64_t a = h0 * g; a < h1 * g; a++) {                                                         \
            const float inv = 1.f / l[a];                                                                   \
            for (int e = 0; e < D; e++) out[a * D + e] = f32_to_bf16(acc[a][e] * inv);                      \
        }                                                                                                   \
    }

DEFINE_ROW_ITEM(bf16_row_item_d64, 2)
DEFINE_ROW_ITEM(bf16_row_item_d128, 4)

/* 1 if the row path ran (every query row), 0 if it does not apply. */
static int bf16_rows_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                               const int64_t *table, int64_t table_stride, const int64_t *req_of,
                               const int64_t *pos_of, int64_t n_q, int64_t hq, int64_t hkv, int64_t d,
                               float scale, int64_t window, float softcap, uint16_t *out, int nthreads,
                               int64_t row_min) {
    /* Rows enough for every thread (row_min: 4 per thread of the engine's full team) take one item
     * per row, all heads; fewer take one item per (row, kv head). Both call the same function and a
     * head's arithmetic does not depend on the heads beside it, so a row's bits are the same whatever
     * the batch (a prompt's last row among its prompt's rows, or alone after a prefix-cache hit). */
    if ((d != 64 && d != 128) || hq > ROW_MAX_HQ) return 0;
    const int64_t heads = n_q >= row_min ? hkv : 1;  /* kv heads per item */
    const int64_t per_row = hkv / heads;              /* items per query row */
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")
    for (int64_t it = 0; it < n_q * per_row; it++) {
        const int64_t i = it / per_row, h0 = it % per_row * heads;
        const int64_t pos = pos_of[i];
        const int64_t *rows = table + req_of[i] * table_stride;
        const int64_t start = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
        if (d == 64)
            bf16_row_item_d64(q + i * q_stride, k, v, rows, start, pos, h0, h0 + heads, hq, hkv, scale, softcap,
                              out + i * hq * d);
        else
            bf16_row_item_d128(q + i * q_stride, k, v, rows, start, pos, h0, h0 + heads, hq, hkv, scale, softcap,
                               out + i * hq * d);
    }
    return 1;
}
#define ROWS_bf16(...) bf16_rows_attention(__VA_ARGS__)
#else
#define ROWS_bf16(...) 0
#endif
#define ROWS_f32(...) 0

/* One work item: query row i, kv heads h0 .. h1-1 (their g = hq / hkv query heads each); `d` is a
 * compile-time constant in the specialised calls (64, 128), so the inner loops unroll into whole
 * vectors. Tokens go block by block; within a block, token by token, every head of the item uses
 * the token's K (V) rows, which for all heads are one contiguous run: a row item (all heads, taken
 * when there are rows enough for every thread) streams each token's rows once, prefetched whole.
 * A head's arithmetic does not depend on which other heads share its item (float32: a row item
 * and the (row, kv head) items give the same bits; tests/models/test_cpu_speed_paths.py). */
#define DEFINE_ATTENTION(NAME, T, LOAD, STORE, AVX, ROWS)                                                              \
    static inline __attribute__((always_inline)) void NAME##_item(                                          \
        const T *q, int64_t q_stride, const T *k, const T *v, const int64_t *rows, int64_t start,            \
        int64_t pos, int64_t i, int64_t h0, int64_t h1, int64_t hq, int64_t hkv, int64_t g, const int64_t d, \
        float scale, float softcap, T *out) {                                                               \
        float qf[ITEM_FLOATS], acc[ITEM_FLOATS], m[ITEM_HEADS], l[ITEM_HEADS];                              \
        float s[ITEM_HEADS][BLOCK], kf[MAX_D];                                                              \
        const int64_t na = (h1 - h0) * g;                 /* query heads of the item, from h0 * g on */     \
        const int64_t span = (h1 - h0) * d * sizeof(T);   /* bytes of a token's K (V) rows for them */      \
        for (int64_t a = 0; a < na; a++) {                                                                  \
            const T *qa = q + i * q_stride + (h0 * g + a) * d;                                              \
            for (int64_t e = 0; e < d; e++) { qf[a * d + e] = LOAD(qa[e]) * scale; acc[a * d + e] = 0.f; }  \
            m[a] = -INFINITY;                                                                               \
            l[a] = 0.f;                                                                                     \
        }                                                                                                   \
        for (int64_t j0 = start; j0 <= pos; j0 += BLOCK) {                                                  \
            const int64_t n = (pos + 1 - j0) < BLOCK ? (pos + 1 - j0) : BLOCK;                              \
            for (int64_t j = 0; j < PREFETCH && j < n; j++) prefetch_span(k + (rows[j0 + j] * hkv + h0) * d, span); \
            for (int64_t j = 0; j < n; j++) {                                                               \
                if (j + PREFETCH < n) prefetch_span(k + (rows[j0 + j + PREFETCH] * hkv + h0) * d, span);    \
                for (int64_t h = h0; h < h1; h++) {                                                         \
                    const T *kr = k + (rows[j0 + j] * hkv + h) * d;                                         \
                    for (int64_t e = 0; e < d; e++) kf[e] = LOAD(kr[e]);                                    \
                    for (int64_t a = (h - h0) * g; a < (h - h0 + 1) * g; a++) {                             \
                        const float *qa = qf + a * d;                                                       \
                        float dot = 0.f;                                                                    \
                        _Pragma("omp simd reduction(+ : dot)")                                              \
                        for (int64_t e = 0; e < d; e++) dot += qa[e] * kf[e];                               \
                        s[a][j] = dot;                                                                      \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
            for (int64_t a = 0; a < na; a++) {                                                              \
                if (softcap > 0.f) cap_scores(s[a], n, softcap);                                            \
                const float corr = online_softmax_block(s[a], n, &m[a], &l[a]);                             \
                for (int64_t e = 0; e < d; e++) acc[a * d + e] *= corr;                                     \
            }                                                                                               \
            for (int64_t j = 0; j < PREFETCH && j < n; j++) prefetch_span(v + (rows[j0 + j] * hkv + h0) * d, span); \
            for (int64_t j = 0; j < n; j++) {                                                               \
                if (j + PREFETCH < n) prefetch_span(v + (rows[j0 + j + PREFETCH] * hkv + h0) * d, span);    \
                for (int64_t h = h0; h < h1; h++) {                                                         \
                    const T *vr = v + (rows[j0 + j] * hkv + h) * d;                                         \
                    for (int64_t e = 0; e < d; e++) kf[e] = LOAD(vr[e]);                                    \
                    for (int64_t a = (h - h0) * g; a < (h - h0 + 1) * g; a++) {                             \
                        float *aa = acc + a * d;                                                            \
                        const float p = s[a][j];                                                            \
                        _Pragma("omp simd")                                                                 \
                        for (int64_t e = 0; e < d; e++) aa[e] += p * kf[e];                                 \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int64_t a = 0; a < na; a++) {                                                                  \
            T *o = out + (i * hq + h0 * g + a) * d;                                                         \
            const float inv = 1.f / l[a];                                                                   \
            for (int64_t e = 0; e < d; e++) o[e] = STORE(acc[a * d + e] * inv);                             \
        }                                                                                                   \
    }                                                                                                       \
    /* One compiled body for both the row items and the (row, kv head) items: copies inlined into  \
     * each loop could be vectorised differently, and then their float32 bits would differ. */      \
    static __attribute__((noinline)) void NAME##_heads(                                                     \
        const T *q, int64_t q_stride, const T *k, const T *v, const int64_t *rows, int64_t start,            \
        int64_t pos, int64_t i, int64_t h0, int64_t h1, int64_t hq, int64_t hkv, int64_t g, int64_t d,     \
        float scale, float softcap, T *out) {                                                               \
        if (d == 64)                                                                                        \
            NAME##_item(q, q_stride, k, v, rows, start, pos, i, h0, h1, hq, hkv, g, 64, scale, softcap, out);        \
        else if (d == 128)                                                                                  \
            NAME##_item(q, q_stride, k, v, rows, start, pos, i, h0, h1, hq, hkv, g, 128, scale, softcap, out);       \
        else                                                                                                \
            NAME##_item(q, q_stride, k, v, rows, start, pos, i, h0, h1, hq, hkv, g, d, scale, softcap, out); \
    }                                                                                                       \
    int NAME(const T *q, int64_t q_stride, T *k, T *v, const int64_t *table, int64_t table_stride,         \
             const int64_t *req_of, const int64_t *pos_of, int64_t n_q, int64_t hq, int64_t hkv, int64_t d, \
             float scale, int64_t window, float softcap, T *out, int nthreads, const T *k_new, const T *v_new, \
             int64_t new_stride, const int64_t *new_loc, int64_t n_new, int64_t row_min) {                  \
        if (d > MAX_D || hq % hkv != 0 || hq / hkv > MAX_G) return -1;                                      \
        /* Store this step's K/V rows first (the barrier at the loop's end orders it before reads). */      \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                 \
        for (int64_t r = 0; r < n_new; r++) {                                                               \
            memcpy(k + new_loc[r] * hkv * d, k_new + r * new_stride, hkv * d * sizeof(T));                  \
            memcpy(v + new_loc[r] * hkv * d, v_new + r * new_stride, hkv * d * sizeof(T));                  \
        }                                                                                                   \
        if (ROWS(q, q_stride, k, v, table, table_stride, req_of, pos_of, n_q, hq, hkv, d, scale, window, softcap, out, \
                 nthreads, row_min))                                                                        \
            return 0;                                                                                       \
        const int64_t g = hq / hkv;                                                                         \
        if (n_q >= row_min && !AVX512_HAS(d, g) && hq <= ITEM_HEADS && hq * d <= ITEM_FLOATS) {            \
            /* Rows enough for every thread (row_min): one item per query row, all heads. */               \
            _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                         \
            for (int64_t i = 0; i < n_q; i++) {                                                             \
                const int64_t pos = pos_of[i];                                                              \
                const int64_t start = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;          \
                NAME##_heads(q, q_stride, k, v, table + req_of[i] * table_stride, start, pos, i, 0, hkv, hq, \
                             hkv, g, d, scale, softcap, out);                                               \
            }                                                                                               \
            return 0;                                                                                       \
        }                                                                                                   \
        const int64_t items = n_q * hkv;                                                                    \
        _Pragma("omp parallel for schedule(dynamic, 4) num_threads(nthreads)")                             \
        for (int64_t it = 0; it < items; it++) {                                                            \
            const int64_t i = it / hkv, h = it % hkv;                                                       \
            const int64_t pos = pos_of[i];                                                                  \
            const int64_t *rows = table + req_of[i] * table_stride;                                         \
            const int64_t start = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;              \
            if (AVX512_ITEM(AVX, q, q_stride, k, v, rows, start, pos, i, h, hq, hkv, g, d, scale, softcap, out)) \
                continue;                                                                                   \
            NAME##_heads(q, q_stride, k, v, rows, start, pos, i, h, h + 1, hq, hkv, g, d, scale, softcap, out); \
        }                                                                                                   \
        return 0;                                                                                           \
    }


DEFINE_ATTENTION(paged_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16, avx512_bf16, ROWS_bf16)
DEFINE_ATTENTION(paged_attention_f32, float, LOAD_F32, STORE_F32, avx512_f32, ROWS_f32)

/* Greedy sampling: the index of each row's largest logit (the first on ties;
 * NaN counts as largest, like torch.argmax). Rows in parallel; within a row a
 * vectorized max per block finds the block, then a short scan the index. */
#define ARGMAX_BLOCK 512
#define DEFINE_ARGMAX(NAME, T, LOAD)                                                                  \
    void NAME(const T *x, int64_t rows, int64_t cols, int64_t *out, int nthreads) {                   \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            const T *row = x + r * cols;                                                              \
            float best = -INFINITY;                                                                   \
            int64_t best_block = 0, nan_block = -1;                                                   \
            for (int64_t b0 = 0; b0 < cols; b0 += ARGMAX_BLOCK) {                                     \
                const int64_t n = cols - b0 < ARGMAX_BLOCK ? cols - b0 : ARGMAX_BLOCK;                \
                float bm = -INFINITY;                                                                 \
                int nans = 0;                                                                         \
                _Pragma("omp simd reduction(max : bm) reduction(+ : nans)")                           \
                for (int64_t c = 0; c < n; c++) {                                                     \
                    const float val = LOAD(row[b0 + c]);                                              \
                    bm = val > bm ? val : bm;                                                         \
                    nans += val != val;                                                               \
                }                                                                                     \
                if (nans) { nan_block = b0; break; }                                                  \
                if (bm > best || b0 == 0) { best = bm; best_block = b0; }                             \
            }                                                                                         \
            const int64_t b0 = nan_block >= 0 ? nan_block : best_block;                               \
            int64_t arg = b0;                                                                         \
            for (int64_t c = b0; c < cols; c++) {                                                     \
                const float val = LOAD(row[c]);                                                       \
                if (nan_block >= 0 ? val != val : val == best) { arg = c; break; }                    \
            }                                                                                         \
            out[r] = arg;                                                                             \
        }                                                                                             \
    }

DEFINE_ARGMAX(argmax_rows_bf16, uint16_t, bf16_to_f32)
DEFINE_ARGMAX(argmax_rows_f32, float, LOAD_F32)

/* ---- fused elementwise ops of a decoder layer (row-parallel) --------------------------------
 * Each matches its eager torch form op by op (float math, one rounding to T per torch op), so
 * the two paths agree to the last bit or ulp; -std=c11 keeps the compiler from fusing a*b+c. */

/* h_out = x + residual (if residual), rounded to T; normed = w * T(h * rsqrt(mean(h^2) + eps)). */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE)                                                         \
    void NAME(const T *x, const T *residual, const T *w, float eps, int64_t rows, int64_t cols,     \
              T *h_out, T *normed, int nthreads) {                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            const T *xr = x + r * cols;                                                               \
            T *hr = h_out + r * cols, *nr = normed + r * cols;                                        \
            float ss = 0.f;                                                                           \
            if (residual) {                                                                           \
                const T *rr = residual + r * cols;                                                    \
                for (int64_t c = 0; c < cols; c++) hr[c] = STORE(LOAD(xr[c]) + LOAD(rr[c]));        \
                xr = hr;                                                                              \
            }                                                                                         \
            _Pragma("omp simd reduction(+ : ss)")                                                     \
            for (int64_t c = 0; c < cols; c++) { const float v = LOAD(xr[c]); ss += v * v; }          \
            const float inv = 1.f / sqrtf(ss / (float)cols + eps);                                    \
            for (int64_t c = 0; c < cols; c++) nr[c] = STORE(LOAD(w[c]) * LOAD(STORE(LOAD(xr[c]) * inv))); \
        }                                                                                             \
    }

/* In place on the first `heads` heads of each row (q then k in the fused qkv output):
 * x = T(x * cos + rotate_half(x) * sin), cos/sin float32 tables [positions, d]. */
#define DEFINE_ROPE(NAME, T, LOAD, STORE)                                                             \
    void NAME(T *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d, const int64_t *pos, \
              const float *cos_t, const float *sin_t, int nthreads) {                                \
        const int64_t half = d / 2;                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            const float *cs = cos_t + pos[r] * d, *sn = sin_t + pos[r] * d;                           \
            for (int64_t h = 0; h < heads; h++) {                                                     \
                T *xh = x + r * row_stride + h * d;                                                   \
                float a[MAX_D];                                                                       \
                for (int64_t e = 0; e < d; e++) a[e] = LOAD(xh[e]);                                   \
                for (int64_t e = 0; e < half; e++) {                                                  \
                    const float p = a[e] * cs[e], q = (-a[e + half]) * sn[e];                         \
                    xh[e] = STORE(p + q);                                                             \
                }                                                                                     \
                for (int64_t e = half; e < d; e++) {                                                  \
                    const float p = a[e] * cs[e], q = a[e - half] * sn[e];                            \
                    xh[e] = STORE(p + q);                                                             \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

/* out = T(T(silu(gate)) * up) for gate_up rows [gate | up] of width 2 * inter. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE)                                                         \
    void NAME(const T *gate_up, int64_t rows, int64_t inter, T *out, int nthreads) {                 \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            const T *g = gate_up + r * 2 * inter, *u = g + inter;                                     \
            T *o = out + r * inter;                                                                   \
            for (int64_t c = 0; c < inter; c++) {                                                     \
                const float x = LOAD(g[c]);                                                           \
                o[c] = STORE(LOAD(STORE(silu_f32(x))) * LOAD(u[c]));                        \
            }                                                                                         \
        }                                                                                             \
    }

#if defined(__AVX512F__)
/* bf16 with AVX-512: the same math 16 lanes at a time, rounding as f32_to_bf16 does (to nearest
 * even, NaN kept), so every element has the generic loop's bits; the sum of squares is summed in
 * another order (as the generic loop's vectorised reduction is). The generic loops, compiled for
 * bf16, ran at ~1.3 GB/s: 222 rows of a 576-wide norm took 104 us, of a 1,536-wide silu_mul 192 us. */

/* v rounded to bf16, as 32-bit lanes holding the bf16 bits. */
static inline __m512i bf16_bits16(__m512 v) {
    const __m512i x = _mm512_castps_si512(v);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i up = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(x, 16), one));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(x, up), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
}

/* LOAD(STORE(v)): v rounded to bf16, back in float32. */
static inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }

static inline void store_bf16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}

/* exp_approx, 16 lanes: the scalar's operations in its order (no fused multiply-adds). */
static inline __m512 exp_approx16(__m512 x) {
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-126.f)), _mm512_set1_ps(127.f));
    const __m512 magic = _mm512_set1_ps(12582912.f);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, magic), magic);
    const __m512 f = _mm512_sub_ps(t, n);
    static const float coef[] = {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f};
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    for (int i = 0; i < 6; i++) p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(coef[i]));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    const __m512 big = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MAX_ARG), _CMP_GT_OQ),
                                          _mm512_set1_ps(INFINITY));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ), big);
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *w, float eps, int64_t rows,
                   int64_t cols, uint16_t *h_out, uint16_t *normed, int nthreads) {
    const int64_t vec = cols / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * cols;
        uint16_t *hr = h_out + r * cols, *nr = normed + r * cols;
        __m512 acc = _mm512_setzero_ps();
        float ss = 0.f;
        if (residual) {
            const uint16_t *rr = residual + r * cols;
            for (int64_t c = 0; c < vec; c += 16) {
                const __m512 h = round_bf16(_mm512_add_ps(LOADV_BF16(xr + c), LOADV_BF16(rr + c)));
                store_bf16(hr + c, h);
                acc = _mm512_add_ps(acc, _mm512_mul_ps(h, h));
            }
            for (int64_t c = vec; c < cols; c++) hr[c] = f32_to_bf16(bf16_to_f32(xr[c]) + bf16_to_f32(rr[c]));
            xr = hr;
        } else {
            for (int64_t c = 0; c < vec; c += 16) {
                const __m512 v = LOADV_BF16(xr + c);
                acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
            }
        }
        for (int64_t c = vec; c < cols; c++) { const float v = bf16_to_f32(xr[c]); ss += v * v; }
        ss += _mm512_reduce_add_ps(acc);
        const float inv = 1.f / sqrtf(ss / (float)cols + eps);
        const __m512 vinv = _mm512_set1_ps(inv);
        for (int64_t c = 0; c < vec; c += 16)
            store_bf16(nr + c, _mm512_mul_ps(LOADV_BF16(w + c), round_bf16(_mm512_mul_ps(LOADV_BF16(xr + c), vinv))));
        for (int64_t c = vec; c < cols; c++)
            nr[c] = f32_to_bf16(bf16_to_f32(w[c]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[c]) * inv)));
    }
}

void silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t inter, uint16_t *out, int nthreads) {
    const int64_t vec = inter / 16 * 16;
    const __m512 one = _mm512_set1_ps(1.f);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        for (int64_t c = 0; c < vec; c += 16) {
            const __m512 x = LOADV_BF16(g + c);
            const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            store_bf16(o + c, _mm512_mul_ps(round_bf16(silu), LOADV_BF16(u + c)));
        }
        for (int64_t c = vec; c < inter; c++)
            o[c] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu_f32(bf16_to_f32(g[c])))) * bf16_to_f32(u[c]));
    }
}
#else
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
#endif
DEFINE_RMS_NORM(rms_norm_f32, float, LOAD_F32, STORE_F32)
DEFINE_ROPE(rope_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ROPE(rope_f32, float, LOAD_F32, STORE_F32)
DEFINE_SILU_MUL(silu_mul_f32, float, LOAD_F32, STORE_F32)

/* ---- grammar masks (constrained decoding) ----------------------------------------------------
 * logits[r, c] = -inf where bit c % 32 of word c / 32 of mask row r is 0, for each listed row r
 * (the same row in logits and mask; xgrammar's bitmask layout), over the first `cols` columns.
 * A word of all ones (the token range is allowed) is skipped; with AVX-512 any other word is one
 * masked store of -inf (bf16: 32 lanes, f32: 2 x 16), the word's complement as the lane mask.
 * Rows in parallel. */
#define BF16_NEG_INF 0xff80u

static inline void mask_word_bf16(uint16_t *x, uint32_t w) {
#if defined(__AVX512BW__)
    _mm512_mask_storeu_epi16(x, (__mmask32)~w, _mm512_set1_epi16((short)BF16_NEG_INF));
#else
    for (int b = 0; b < 32; b++) if (!((w >> b) & 1u)) x[b] = BF16_NEG_INF;
#endif
}

static inline void mask_word_f32(float *x, uint32_t w) {
#if defined(__AVX512F__)
    const __m512 neg = _mm512_set1_ps(-INFINITY);
    _mm512_mask_storeu_ps(x, (__mmask16)~w, neg);
    _mm512_mask_storeu_ps(x + 16, (__mmask16)(~w >> 16), neg);
#else
    for (int b = 0; b < 32; b++) if (!((w >> b) & 1u)) x[b] = -INFINITY;
#endif
}

#define DEFINE_APPLY_BITMASK(NAME, T, MASK_WORD, NEG_INF)                                             \
    void NAME(T *logits, int64_t row_stride, const int32_t *mask, int64_t mask_stride,              \
              const int64_t *rows, int64_t n_rows, int64_t cols, int nthreads) {                    \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
        for (int64_t i = 0; i < n_rows; i++) {                                                        \
            T *x = logits + rows[i] * row_stride;                                                     \
            const uint32_t *m = (const uint32_t *)(mask + rows[i] * mask_stride);                     \
            const int64_t full = cols / 32;                                                           \
            for (int64_t k = 0; k < full; k++)                                                        \
                if (m[k] != 0xffffffffu) MASK_WORD(x + 32 * k, m[k]);                                 \
            for (int64_t c = 32 * full; c < cols; c++) /* a partial last word */                      \
                if (!((m[full] >> (c - 32 * full)) & 1u)) x[c] = NEG_INF;                             \
        }                                                                                             \
    }

DEFINE_APPLY_BITMASK(apply_token_bitmask_bf16, uint16_t, mask_word_bf16, BF16_NEG_INF)
DEFINE_APPLY_BITMASK(apply_token_bitmask_f32, float, mask_word_f32, -INFINITY)
