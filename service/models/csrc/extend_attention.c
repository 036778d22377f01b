/* Extend attention on CPU: the new query rows of a prompt (or of a chunk of one) over their
 * request's rows of the paged KV pool, read in place (no gather into a contiguous copy, no
 * repeat of the kv heads for their query heads). Causal, optional sliding window and score
 * soft-capping (Gemma-2). What the extends of more than a few rows take; decode rows and
 * short chunks go to paged_attention (cpu_kernels.c).
 *
 * Layouts (contiguous unless a stride is given):
 *   q     [T, hq, d], row stride q_stride   the batch's packed query rows
 *   k, v  [pool, hkv, d]                    the layer's KV pool (this step's rows already stored)
 *   table [bs, table_stride]                pool row of each request's kv position
 *   out   [T, hq, d], row stride out_stride
 * Request r (req_row[r] in the table) has kv_len[r] positions; its n_new[r] query rows start
 * at packed row q_start[r] and sit at positions kv_len - n_new .. kv_len - 1.
 *
 * Per request and kv head: the head's K rows are packed once into key blocks of KB positions
 * (blocks at fixed positions: block b holds keys b*KB .. b*KB+KB-1), its V rows read in place
 * (widened to float32 as P.V loads them) or, with bf16 weights, packed as pairs of keys; then
 * work items of up to R_MAX rows (consecutive query positions x the g query heads of the kv
 * head, which share every K/V load) run in parallel. An item takes the blocks its rows reach:
 * the scores of the block for its rows are a small GEMM (bf16 pairs with vdpbf16ps on AVX-512
 * BF16, exact products summed in float32; float32 FMAs elsewhere, AVX-512F or AVX2), then an
 * online softmax per row and P.V, register-blocked over rows: float32, or on AVX-512 BF16 (head
 * sizes 64 and 128, up to BF16_ROW_MAX_HQ query heads) on bf16 weights by vdpbf16ps, as flash
 * attention does on GPUs.
 *
 * A row's arithmetic depends only on its query, its position and the keys (a block a row does
 * not reach is skipped for it, the keys it must not see weigh exactly 0): the same row gives the
 * same bits whichever item, chunk or batch it is computed in, so a prompt in chunks equals the
 * prompt in one piece. Needs AVX2 + FMA at least (extend_attention_isa() == 0: not built);
 * head_dim a multiple of 16, at most 256.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

#define KB 64    /* keys per block */
#define R_MAX 64 /* rows (query positions x group heads) per work item */
#define EXT_MAX_D 256
#define EXT_MAX_G 16

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <omp.h>
#define EXTEND_BUILT 1

#if defined(__AVX512F__)
#define VL 16
#define QK_NR 4 /* rows x QK_NV vectors of accumulators in a score tile */
#define QK_NV 4 /* vectors of keys in a score tile */
#define PV_NR 6 /* rows x PV_NV vectors of accumulators in a P.V tile: 24 of the 32 registers */
#define PV_NV 4 /* vectors of head_dim in a P.V tile */
typedef __m512 vf;
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vfma _mm512_fmadd_ps
static inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline float vhsum(vf x) { return _mm512_reduce_add_ps(x); }
static inline vf vexp2(vf t) { return exp2_nonpositive16(t); } /* kernel_math.h */
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#else
#define VL 8
/* AVX2 has 16 vector registers: 6 x 2 accumulators, 2 operands, a broadcast. Twelve chains of
 * FMAs hide the FMA latency (two pipes x four cycles need eight), and a tile loads 8 vectors for
 * 12 FMAs; 2 x 4 (8 chains, 6 loads for 8 FMAs) left the pipes waiting. */
#define QK_NR 6
#define QK_NV 2
#define PV_NR 6
#define PV_NV 2
typedef __m256 vf;
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vfma _mm256_fmadd_ps
static inline float vhmax(vf x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
static inline float vhsum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#define EXP2_MIN -127.f /* n = -127 builds the bits of 0.0: a weight below 2^-126 is exactly 0 */
static inline vf vtimes_pow2(vf p, vf n) { /* p * 2^n, n integral in [-127, 0] */
    return vmul(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
}
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
/* 2^t for t <= 0 (a softmax weight), exp2_nonpositive16's steps on 8 lanes (kernel_math.h); t below
 * EXP2_MIN (a key the row must not see: -inf) gives exactly 0. */
static inline vf vexp2(vf t) {
    t = vmax(vset1(EXP2_MIN), t);
    const vf n = vround(t), f = vsub(t, n);
    vf p = vset1(1.5403530e-4f);
    p = vfma(p, f, vset1(1.3333558e-3f));
    p = vfma(p, f, vset1(9.6181291e-3f));
    p = vfma(p, f, vset1(5.5504109e-2f));
    p = vfma(p, f, vset1(2.4022651e-1f));
    p = vfma(p, f, vset1(6.9314718e-1f));
    p = vfma(p, f, vset1(1.0f));
    return vtimes_pow2(p, n);
}
#endif

/* The paths: float32 scores of float32 inputs, or of bf16 inputs widened (where vdpbf16ps is
 * missing), or bf16 scores by vdpbf16ps, whose lanes sum two exact products of bf16 pairs into
 * float32. Weights and P.V are float32 in the first two, and in the third where paged_attention's
 * row items do not run (head sizes other than 64 and 128, more than BF16_ROW_MAX_HQ query heads).
 * Where they run, both kernels round the
 * weights to bf16 alike (`bf16_softmax_block`, kernel_math.h) and this one's P.V takes vdpbf16ps:
 * half the instructions of float32 FMAs, most of the kernel's time before (a 22-row turn over
 * 1,022 keys, one layer of SmolLM2 on a Zen 4: 476 -> 381 us). Either way a row computed by one
 * kernel or the other rounds to the same bf16 but rarely apart (a prompt's rows go to either by
 * chunk length: tests/models/test_cpu_speed_paths.py). */
enum { PATH_F32 = 0, PATH_BF16_INPUT = 1, PATH_BF16_DP = 2 };

typedef struct {
    const void *q;
    int64_t q_stride;
    const void *k, *v;
    const int64_t *rows; /* the request's table row */
    int64_t kv_len, n_new, q_start, p0;
    int64_t hq, hkv, g, d, h;
    float scale, softcap;
    int64_t window;
    void *out;
    int64_t out_stride;
    int path;
    int64_t b_lo; /* first block packed */
    void *kpack;         /* the head's K blocks, as the path's score tile reads them */
    const void **vrows;  /* per key of those blocks, its V row in the pool */
    int bf16_weights;    /* P.V on bf16 weights (vdpbf16ps), the V rows packed as pairs of keys */
    void *vpairs;        /* then: the blocks' V rows (pack_v_pairs) */
} Job;

static inline int64_t row_start(const Job *j, int64_t pos) {
    return (j->window > 0 && pos - j->window + 1 > 0) ? pos - j->window + 1 : 0;
}

/* Key j's row for kv head h in the pool (j < kv_len). */
static inline const void *kv_row(const Job *jb, const void *pool, int64_t j) {
    const int64_t off = (jb->rows[j] * jb->hkv + jb->h) * jb->d;
    return jb->path == PATH_F32 ? (const void *)((const float *)pool + off) : (const void *)((const uint16_t *)pool + off);
}

/* Zeros standing in for the V rows of keys past kv_len (never weighed: P.V stops at a row's last key). */
static const float ZERO_ROW[EXT_MAX_D] __attribute__((aligned(64)));

/* Eight rows of 8 x 32 bits (key t + i at rows[i] + e) as eight columns (element e + j of the eight
 * keys at out + j * ld): a transpose by shuffles, every bit copied. */
static inline void transpose8_store(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5,
                                    __m256 r6, __m256 r7, float *out, int64_t ld) {
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
    _mm256_storeu_ps(out + 0 * ld, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(out + 1 * ld, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(out + 2 * ld, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(out + 3 * ld, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(out + 4 * ld, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(out + 5 * ld, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(out + 6 * ld, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(out + 7 * ld, _mm256_permute2f128_ps(s3, s7, 0x31));
}

/* Eight elements e .. e + 7 of a K row as the packed block holds them: float32 (read, or bf16
 * widened), or (PATH_BF16_DP) bf16 pairs e .. e + 7, four bytes each, bits copied as they are. */
static inline __m256 pack_load8(int path, const void *row, int64_t e) {
    if (path == PATH_BF16_INPUT)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + e))), 16));
    return _mm256_loadu_ps((const float *)row + e);
}

/* Element e of a K row to *out as pack_load8 reads it, one at a time (a block's last keys). */
static inline void pack_copy1(int path, const void *row, int64_t e, float *out) {
    if (path == PATH_BF16_INPUT)
        *out = bf16_to_f32(((const uint16_t *)row)[e]);
    else
        memcpy(out, (const char *)row + 4 * e, 4); /* float32, or a bf16 pair: its bits as they are */
}

/* A block's V rows as the bf16 P.V tile reads them: pairs of consecutive keys (2i, 2i + 1) per
 * element, [KB/2][d] 32-bit lanes, key 2i in the low half (bits copied; keys past n zeros). */
static void pack_v_pairs(const Job *jb, uint32_t *out, int64_t j0, int64_t n) {
    const int64_t d = jb->d;
    for (int64_t t = 0; t < KB; t += 2) {
        uint32_t *dst = out + (t / 2) * d;
        if (t >= n) {
            memset(dst, 0, d * sizeof(uint32_t));
            continue;
        }
        const uint16_t *a = kv_row(jb, jb->v, j0 + t);
        const uint16_t *b = t + 1 < n ? (const uint16_t *)kv_row(jb, jb->v, j0 + t + 1) : NULL;
        for (int64_t e = 0; e < d; e += 8) {
            const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a + e)));
            const __m256i hi = b ? _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + e))), 16)
                                 : _mm256_setzero_si256();
            _mm256_storeu_si256((__m256i *)(dst + e), _mm256_or_si256(lo, hi));
        }
    }
}

/* Pack block b of the head: K as the path's score tile reads it, float32 [d][KB] (a key per lane)
 * or bf16 pairs [d/2][KB] (bits copied), keys past kv_len zeros; V stays in the pool, the block
 * keeps a pointer to each key's row (P.V widens bf16 rows as it reads them), and with bf16
 * weights V is packed as pairs of keys too (pack_v_pairs). Keys go eight at a
 * time through a transpose, with the next eight's K and V rows prefetched (P.V then finds its V
 * rows in cache). */
static void pack_block(const Job *jb, int64_t b) {
    const int64_t d = jb->d, slot = b - jb->b_lo, j0 = b * KB;
    const int64_t n = jb->kv_len - j0 < KB ? jb->kv_len - j0 : KB; /* keys in the block */
    const int64_t row_bytes = d * (jb->path == PATH_F32 ? 4 : 2);
    const int dp = jb->path == PATH_BF16_DP;
    const int64_t cols = dp ? d / 2 : d; /* 32-bit elements of a packed key */
    const void **vr = jb->vrows + slot * KB;
    for (int64_t t = 0; t < KB; t++) vr[t] = t < n ? kv_row(jb, jb->v, j0 + t) : (const void *)ZERO_ROW;
    float *kb = dp ? (float *)((uint32_t *)jb->kpack + slot * KB * (d / 2)) : (float *)jb->kpack + slot * KB * d;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const void *kr[8];
        for (int i = 0; i < 8; i++) kr[i] = kv_row(jb, jb->k, j0 + t + i);
        for (int64_t i = t + 8; i < t + 16 && i < n; i++) {
            prefetch_span(kv_row(jb, jb->k, j0 + i), row_bytes);
            prefetch_span(vr[i], row_bytes);
        }
        for (int64_t e = 0; e < cols; e += 8)
            transpose8_store(pack_load8(jb->path, kr[0], e), pack_load8(jb->path, kr[1], e),
                             pack_load8(jb->path, kr[2], e), pack_load8(jb->path, kr[3], e),
                             pack_load8(jb->path, kr[4], e), pack_load8(jb->path, kr[5], e),
                             pack_load8(jb->path, kr[6], e), pack_load8(jb->path, kr[7], e), kb + e * KB + t, KB);
    }
    for (; t < n; t++) {
        const void *kr = kv_row(jb, jb->k, j0 + t);
        for (int64_t e = 0; e < cols; e++) pack_copy1(jb->path, kr, e, kb + e * KB + t);
    }
    for (; t < KB; t++)
        for (int64_t e = 0; e < cols; e++) kb[e * KB + t] = 0.f; /* all bits 0: a zero pair too */
    if (jb->bf16_weights) pack_v_pairs(jb, (uint32_t *)jb->vpairs + slot * (KB / 2) * d, j0, n); /* rows in cache now */
}

/* Scores of nr rows (q float32, row stride d) over QK_NV * VL keys of a [d][KB] block. */
static inline __attribute__((always_inline)) void qk_f32_tile(const int nr, const float *q, int64_t d,
                                                              const float *kt, float *s) {
    vf c[QK_NR][QK_NV];
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < QK_NV; x++) c[r][x] = vzero();
    for (int64_t e = 0; e < d; e++) {
        vf kx[QK_NV];
        for (int x = 0; x < QK_NV; x++) kx[x] = vload(kt + e * KB + x * VL);
        for (int r = 0; r < nr; r++) {
            const vf qb = vset1(q[r * d + e]);
            for (int x = 0; x < QK_NV; x++) c[r][x] = vfma(qb, kx[x], c[r][x]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < QK_NV; x++) vstore(s + r * KB + x * VL, c[r][x]);
}

static void qk_f32(const float *q, int64_t nrows, int64_t d, const float *kt, float *s) {
    for (int64_t r0 = 0; r0 < nrows; r0 += QK_NR) {
        const int64_t nr = nrows - r0 < QK_NR ? nrows - r0 : QK_NR;
        for (int64_t c0 = 0; c0 < KB; c0 += QK_NV * VL) {
            const float *qr = q + r0 * d;
            float *sr = s + r0 * KB + c0;
            switch (nr) {
                case 1: qk_f32_tile(1, qr, d, kt + c0, sr); break;
                case 2: qk_f32_tile(2, qr, d, kt + c0, sr); break;
                case 3: qk_f32_tile(3, qr, d, kt + c0, sr); break;
#if QK_NR > 4
                case 4: qk_f32_tile(4, qr, d, kt + c0, sr); break;
                case 5: qk_f32_tile(5, qr, d, kt + c0, sr); break;
#endif
                default: qk_f32_tile(QK_NR, qr, d, kt + c0, sr); break;
            }
        }
    }
}

#if defined(__AVX512BF16__)
/* Scores of nr rows (q bf16, row stride d) over a block's KB = 4 x 16 keys, bf16 pairs [d/2][KB]. */
static inline __attribute__((always_inline)) void qk_bf16_tile(const int nr, const uint16_t *q, int64_t d,
                                                               const uint32_t *kp, float *s) {
    __m512 c[4][4];
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < 4; x++) c[r][x] = _mm512_setzero_ps();
    for (int64_t e2 = 0; e2 < d / 2; e2++) {
        __m512bh kx[4];
        for (int x = 0; x < 4; x++) kx[x] = (__m512bh)_mm512_loadu_si512(kp + e2 * KB + 16 * x);
        for (int r = 0; r < nr; r++) {
            int32_t pair;
            memcpy(&pair, q + r * d + 2 * e2, 4);
            const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
            for (int x = 0; x < 4; x++) c[r][x] = _mm512_dpbf16_ps(c[r][x], qb, kx[x]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < 4; x++) _mm512_storeu_ps(s + r * KB + 16 * x, c[r][x]);
}

static void qk_bf16(const uint16_t *q, int64_t nrows, int64_t d, const uint32_t *kp, float *s) {
    for (int64_t r0 = 0; r0 < nrows; r0 += 4) {
        const uint16_t *qr = q + r0 * d;
        float *sr = s + r0 * KB;
        switch (nrows - r0) {
            case 1: qk_bf16_tile(1, qr, d, kp, sr); break;
            case 2: qk_bf16_tile(2, qr, d, kp, sr); break;
            case 3: qk_bf16_tile(3, qr, d, kp, sr); break;
            default: qk_bf16_tile(4, qr, d, kp, sr); break;
        }
    }
}
#endif

/* A row's block of dot products s[KB] (keys j0 ..): soft-capped scores in place if softcap, keys
 * outside [lo, hi] -inf; returns the score per unit of s (the scale, or 1 once capped). */
static inline float cap_and_mask(float *s, int64_t j0, int64_t lo, int64_t hi, float scale, float softcap) {
    float unit = scale; /* score per unit of s */
    if (softcap > 0.f) {
        for (int t = 0; t < KB; t++) s[t] = tanhf(s[t] * scale / softcap) * softcap;
        unit = 1.f;
    }
    if (j0 < lo || j0 + KB - 1 > hi)
        for (int t = 0; t < KB; t++)
            if (j0 + t < lo || j0 + t > hi) s[t] = -INFINITY;
    return unit;
}

/* One row's block of dot products s[KB] (keys j0 ..) -> softmax weights exp(score - new max) in
 * place (float32), keys outside [lo, hi] weighing exactly 0; score = dot * scale (soft-capped if
 * softcap). The running max m (in the units s holds: dots, or capped scores) and sum l move on;
 * returns the factor the row's accumulators take. */
static inline float softmax_block(float *s, int64_t j0, int64_t lo, int64_t hi, float scale,
                                  float softcap, float *m, float *l) {
    const float unit = cap_and_mask(s, j0, lo, hi, scale, softcap);
    vf mx = vload(s);
    for (int x = 1; x < KB / VL; x++) mx = vmax(mx, vload(s + x * VL));
    const float block_max = vhmax(mx), bm = block_max > *m ? block_max : *m;
    const float corr = exp_approx((*m - bm) * unit);
    const vf k = vset1(unit * 1.44269504088896341f), kbm = vset1(bm * unit * 1.44269504088896341f);
    vf sum = vzero();
    for (int x = 0; x < KB / VL; x++) {
        const vf p = vexp2(vsub(vmul(vload(s + x * VL), k), kbm));
        vstore(s + x * VL, p);
        sum = vadd(sum, p);
    }
    *m = bm;
    *l = *l * corr + vhsum(sum);
    return corr;
}

/* acc[nr rows][nv vectors] = acc * corr + P . V over keys 0 .. nk-1 of the block (float32). */
static inline __attribute__((always_inline)) void pv_tile(const int nr, const int nv, const int bf16, float *acc,
                                                          int64_t d, const float *p, const float *corr,
                                                          const void *const *vr, int64_t e0, int64_t nk) {
    vf a[PV_NR][PV_NV];
    for (int r = 0; r < nr; r++) {
        const vf c = vset1(corr[r]);
        for (int x = 0; x < nv; x++) a[r][x] = vmul(vload(acc + r * d + x * VL), c);
    }
    for (int64_t t = 0; t < nk; t++) {
        vf vv[PV_NV];
        for (int x = 0; x < nv; x++)
            vv[x] = bf16 ? vload_bf16((const uint16_t *)vr[t] + e0 + x * VL) : vload((const float *)vr[t] + e0 + x * VL);
        for (int r = 0; r < nr; r++) {
            const vf pb = vset1(p[r * KB + t]);
            for (int x = 0; x < nv; x++) a[r][x] = vfma(pb, vv[x], a[r][x]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < nv; x++) vstore(acc + r * d + x * VL, a[r][x]);
}

#if PV_NR > 4
#define PV_MORE_CASES(NV, BF)                                                                       \
    case 4: pv_tile(4, NV, BF, ac, d, pr, cr, vr, e0, nk); break;                                   \
    case 5: pv_tile(5, NV, BF, ac, d, pr, cr, vr, e0, nk); break;
#else
#define PV_MORE_CASES(NV, BF)
#endif
#define PV_CASES(NV, BF)                                                                            \
    switch (nr) {                                                                                   \
        case 1: pv_tile(1, NV, BF, ac, d, pr, cr, vr, e0, nk); break;                               \
        case 2: pv_tile(2, NV, BF, ac, d, pr, cr, vr, e0, nk); break;                               \
        case 3: pv_tile(3, NV, BF, ac, d, pr, cr, vr, e0, nk); break;                               \
        PV_MORE_CASES(NV, BF)                                                                       \
        default: pv_tile(PV_NR, NV, BF, ac, d, pr, cr, vr, e0, nk); break;                          \
    }

/* P.V for rows r0 .. r1-1 of an item; vr: the block's V rows (bf16: widened as read); nk_of[r]: keys
 * of the block the row may weigh (past them its weights are 0, so leaving them out changes no bit). */
static void pv_rows(float *acc, int64_t d, const float *p, const float *corr, const void *const *vr, int bf16,
                    int64_t r0, int64_t r1, const int64_t *nk_of) {
    for (int64_t ra = r0; ra < r1; ra += PV_NR) {
        const int64_t nr = r1 - ra < PV_NR ? r1 - ra : PV_NR;
        int64_t nk = 0;
        for (int64_t r = ra; r < ra + nr; r++) nk = nk_of[r] > nk ? nk_of[r] : nk;
        for (int64_t e0 = 0; e0 < d;) {
            float *ac = acc + ra * d + e0;
            const float *pr = p + ra * KB, *cr = corr + ra;
            if (d - e0 >= PV_NV * VL) {
                if (bf16) {
                    PV_CASES(PV_NV, 1);
                } else {
                    PV_CASES(PV_NV, 0);
                }
                e0 += PV_NV * VL;
            } else {
                if (bf16) {
                    PV_CASES(1, 1);
                } else {
                    PV_CASES(1, 0);
                }
                e0 += VL;
            }
        }
    }
}

#if defined(__AVX512BF16__)
/* A row's KB weights (float32 values of bf16 numbers) -> KB/2 bf16 pairs (keys 2i, 2i + 1), exact,
 * in place at the row's start (each half is read before its pairs are written over it). */
static inline void weights_to_pairs(float *s) {
    for (int x = 0; x < KB / 32; x++) {
        const __m512 a = _mm512_loadu_ps(s + 32 * x), b = _mm512_loadu_ps(s + 32 * x + 16);
        _mm512_storeu_si512((uint32_t *)s + 16 * x, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

/* softmax_block for P.V on bf16 weights: the block's scores capped, masked and scaled (before
 * log2 e, as the paged kernel's are: the same x), weighed by bf16_softmax_block (kernel_math.h), and
 * left as pairs of keys at the row's start. */
static inline float pair_weights_block(float *s, int64_t j0, int64_t lo, int64_t hi, float scale, float softcap,
                                       float *m, float *l) {
    const float unit = cap_and_mask(s, j0, lo, hi, scale, softcap);
    if (unit != 1.f)
        for (int x = 0; x < KB / 16; x++)
            _mm512_storeu_ps(s + 16 * x, _mm512_mul_ps(_mm512_loadu_ps(s + 16 * x), _mm512_set1_ps(unit)));
    const float corr = bf16_softmax_block(s, KB, 1.44269504088896341f, m, l);
    weights_to_pairs(s);
    return corr;
}

/* acc[nr rows][nv vectors] = acc * corr + P . V over key pairs 0 .. np-1 of the block: bf16 weights
 * times bf16 values by vdpbf16ps (each lane adds two exact products), summed in float32. */
static inline __attribute__((always_inline)) void pv_bf16_tile(const int nr, const int nv, float *acc, int64_t d,
                                                               const uint32_t *p, const float *corr,
                                                               const uint32_t *vp, int64_t e0, int64_t np) {
    __m512 a[PV_NR][PV_NV];
    for (int r = 0; r < nr; r++) {
        const __m512 c = _mm512_set1_ps(corr[r]);
        for (int x = 0; x < nv; x++) a[r][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + x * 16), c);
    }
    for (int64_t t = 0; t < np; t++) {
        __m512bh vv[PV_NV];
        for (int x = 0; x < nv; x++) vv[x] = (__m512bh)_mm512_loadu_si512(vp + t * d + e0 + x * 16);
        for (int r = 0; r < nr; r++) {
            int32_t pair;
            memcpy(&pair, p + r * KB + t, 4);
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
            for (int x = 0; x < nv; x++) a[r][x] = _mm512_dpbf16_ps(a[r][x], pb, vv[x]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < nv; x++) _mm512_storeu_ps(acc + r * d + x * 16, a[r][x]);
}

#define PV_BF16_CASES(NV)                                                                           \
    switch (nr) {                                                                                   \
        case 1: pv_bf16_tile(1, NV, ac, d, pr, cr, vp, e0, np); break;                              \
        case 2: pv_bf16_tile(2, NV, ac, d, pr, cr, vp, e0, np); break;                              \
        case 3: pv_bf16_tile(3, NV, ac, d, pr, cr, vp, e0, np); break;                              \
        case 4: pv_bf16_tile(4, NV, ac, d, pr, cr, vp, e0, np); break;                              \
        case 5: pv_bf16_tile(5, NV, ac, d, pr, cr, vp, e0, np); break;                              \
        default: pv_bf16_tile(PV_NR, NV, ac, d, pr, cr, vp, e0, np); break;                         \
    }

/* pv_rows on bf16 weights: p holds each row's weights as pairs (weights_to_pairs), vp the block's V
 * pairs (pack_v_pairs). A row weighs the pairs up to its last key (past it its weights are 0). */
static void pv_bf16_rows(float *acc, int64_t d, const float *p, const float *corr, const uint32_t *vp,
                         int64_t r0, int64_t r1, const int64_t *nk_of) {
    for (int64_t ra = r0; ra < r1; ra += PV_NR) {
        const int64_t nr = r1 - ra < PV_NR ? r1 - ra : PV_NR;
        int64_t nk = 0;
        for (int64_t r = ra; r < ra + nr; r++) nk = nk_of[r] > nk ? nk_of[r] : nk;
        const int64_t np = (nk + 1) / 2;
        for (int64_t e0 = 0; e0 < d;) {
            float *ac = acc + ra * d + e0;
            const uint32_t *pr = (const uint32_t *)(p + ra * KB);
            const float *cr = corr + ra;
            if (d - e0 >= PV_NV * 16) {
                PV_BF16_CASES(PV_NV);
                e0 += PV_NV * 16;
            } else {
                PV_BF16_CASES(1);
                e0 += 16;
            }
        }
    }
}
#endif

/* Per-thread buffers of an item: its queries, scores, accumulators, running max / sum. */
typedef struct {
    float *qf;     /* [R_MAX][d] queries as float32 (the float32 path) */
    uint16_t *qb;  /* [R_MAX][d] queries as bf16 (the vdpbf16ps path; the same memory as qf) */
    float *s;      /* [R_MAX][KB] a block's scores, then weights */
    float *acc;    /* [R_MAX][d] */
    float *m, *l, *corr; /* [R_MAX] running max, running sum, this block's factor */
    int64_t *nk;   /* [R_MAX] keys of this block a row may weigh */
} ItemBuffers;

/* The buffers carved out of one thread's region (item_bytes(d) bytes). */
static ItemBuffers item_buffers(char *at, int64_t d) {
    ItemBuffers w;
    w.qf = (float *)at, w.qb = (uint16_t *)at, at += R_MAX * d * sizeof(float);
    w.s = (float *)at, at += R_MAX * KB * sizeof(float);
    w.acc = (float *)at, at += R_MAX * d * sizeof(float);
    w.m = (float *)at, at += R_MAX * sizeof(float);
    w.l = (float *)at, at += R_MAX * sizeof(float);
    w.corr = (float *)at, at += R_MAX * sizeof(float);
    w.nk = (int64_t *)at;
    return w;
}

static int64_t item_bytes(int64_t d) {
    const int64_t bytes = R_MAX * (2 * d * sizeof(float) + KB * sizeof(float) +
                                   3 * sizeof(float) + sizeof(int64_t));
    return (bytes + 63) / 64 * 64;
}

/* Query positions p0 + t0 .. p0 + t0 + nt - 1 of kv head h: rows (t, a) = t * g + a. */
static void extend_item(const Job *jb, const ItemBuffers *w, int64_t t0, int64_t nt) {
    const int64_t g = jb->g, d = jb->d, nrows = nt * g;
    for (int64_t t = 0; t < nt; t++)
        for (int64_t a = 0; a < g; a++) {
            const int64_t r = t * g + a, src = (jb->q_start + t0 + t) * jb->q_stride + (jb->h * g + a) * d;
            if (jb->path == PATH_F32)
                memcpy(w->qf + r * d, (const float *)jb->q + src, d * sizeof(float));
            else if (jb->path == PATH_BF16_INPUT)
                for (int64_t e = 0; e < d; e++) w->qf[r * d + e] = bf16_to_f32(((const uint16_t *)jb->q)[src + e]);
            else
                memcpy(w->qb + r * d, (const uint16_t *)jb->q + src, d * sizeof(uint16_t));
            w->m[r] = -INFINITY;
            w->l[r] = 0.f;
        }
    memset(w->acc, 0, nrows * d * sizeof(float));
    const int64_t pos_lo = jb->p0 + t0, pos_hi = pos_lo + nt - 1;
    for (int64_t b = row_start(jb, pos_lo) / KB; b <= pos_hi / KB; b++) {
        const int64_t j0 = b * KB;
        /* the rows that reach this block: positions >= j0 whose window starts before its end */
        int64_t ta = j0 - pos_lo > 0 ? j0 - pos_lo : 0, tb = nt;
        while (tb > ta && row_start(jb, pos_lo + tb - 1) > j0 + KB - 1) tb--;
        if (ta >= tb) continue;
        const int64_t ra = ta * g, rb = tb * g, slot = b - jb->b_lo;
#if defined(__AVX512BF16__)
        if (jb->path == PATH_BF16_DP)
            qk_bf16(w->qb + ra * d, rb - ra, d, (const uint32_t *)jb->kpack + slot * KB * (d / 2), w->s + ra * KB);
        else
#endif
            qk_f32(w->qf + ra * d, rb - ra, d, (const float *)jb->kpack + slot * KB * d, w->s + ra * KB);
        for (int64_t r = ra; r < rb; r++) {
            const int64_t pos = pos_lo + r / g;
#if defined(__AVX512BF16__)
            if (jb->bf16_weights)
                w->corr[r] = pair_weights_block(w->s + r * KB, j0, row_start(jb, pos), pos, jb->scale,
                                                jb->softcap, &w->m[r], &w->l[r]);
            else
#endif
                w->corr[r] = softmax_block(w->s + r * KB, j0, row_start(jb, pos), pos, jb->scale, jb->softcap,
                                           &w->m[r], &w->l[r]);
            w->nk[r] = pos - j0 + 1 < KB ? pos - j0 + 1 : KB;
        }
#if defined(__AVX512BF16__)
        if (jb->bf16_weights)
            pv_bf16_rows(w->acc, d, w->s, w->corr, (const uint32_t *)jb->vpairs + slot * (KB / 2) * d, ra, rb,
                         w->nk);
        else
#endif
            pv_rows(w->acc, d, w->s, w->corr, jb->vrows + slot * KB, jb->path != PATH_F32, ra, rb, w->nk);
    }
    for (int64_t t = 0; t < nt; t++)
        for (int64_t a = 0; a < g; a++) {
            const int64_t r = t * g + a;
            const int64_t dst = (jb->q_start + t0 + t) * jb->out_stride + (jb->h * g + a) * d;
            const float inv = 1.f / w->l[r];
            if (jb->path == PATH_F32)
                for (int64_t e = 0; e < d; e++) ((float *)jb->out)[dst + e] = w->acc[r * d + e] * inv;
            else
                for (int64_t e = 0; e < d; e++) ((uint16_t *)jb->out)[dst + e] = f32_to_bf16(w->acc[r * d + e] * inv);
        }
}

/* One request's rows for kv head h: pack its blocks, then the items (the last ones, which reach
 * the most blocks, first). `threads`: nthreads regions of item_bytes(d) each. */
static void extend_head(Job *jb, char *threads, int nthreads) {
    /* query positions per item: at most R_MAX rows, and at least one item per thread while there
     * are rows enough, split evenly (a short chunk of 22 rows on two threads: 11 + 11, not 21 + 1) */
    const int64_t qt_max = R_MAX / jb->g;
    int64_t items = (jb->n_new + qt_max - 1) / qt_max;
    if (items < nthreads) items = nthreads < jb->n_new ? nthreads : jb->n_new;
    const int64_t qt = (jb->n_new + items - 1) / items;
    items = (jb->n_new + qt - 1) / qt;
    const int64_t b_hi = (jb->kv_len - 1) / KB;
    const int64_t d = jb->d;
    jb->b_lo = row_start(jb, jb->p0) / KB;
    _Pragma("omp parallel num_threads(nthreads)") {
        _Pragma("omp for schedule(static)") for (int64_t b = jb->b_lo; b <= b_hi; b++) pack_block(jb, b);
        const ItemBuffers w = item_buffers(threads + omp_get_thread_num() * item_bytes(d), d);
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t it = items - 1; it >= 0; it--) {
            const int64_t t0 = it * qt;
            extend_item(jb, &w, t0, jb->n_new - t0 < qt ? jb->n_new - t0 : qt);
        }
    }
}

/* One kv head's packed K (float32, or bf16 pairs and then the V pairs: 4 bytes an element) and V
 * row pointers. */
static int64_t pack_bytes(int64_t max_len, int64_t d) {
    return (max_len + KB - 1) / KB * KB * (d * sizeof(float) + sizeof(void *));
}

static int extend_attention(int path, const void *q, int64_t q_stride, const void *k, const void *v,
                            const int64_t *table, int64_t table_stride, int64_t n_req, const int64_t *req_row,
                            const int64_t *q_start, const int64_t *n_new, const int64_t *kv_len, int64_t hq,
                            int64_t hkv, int64_t d, float scale, int64_t window, float softcap, void *out,
                            int64_t out_stride, void *scratch, int64_t scratch_bytes, int nthreads) {
    if (d % 16 != 0 || d > EXT_MAX_D || hq % hkv != 0 || hq / hkv > EXT_MAX_G || nthreads < 1) return -1;
    int64_t max_len = 0;
    for (int64_t r = 0; r < n_req; r++) max_len = kv_len[r] > max_len ? kv_len[r] : max_len;
    const int64_t packed = pack_bytes(max_len, d);
    if (packed + nthreads * item_bytes(d) > scratch_bytes) return -1;
    for (int64_t r = 0; r < n_req; r++) {
        if (n_new[r] <= 0) continue;
        const int64_t blocks = (kv_len[r] + KB - 1) / KB;
        Job jb = {
            .q = q, .q_stride = q_stride, .k = k, .v = v, .rows = table + req_row[r] * table_stride,
            .kv_len = kv_len[r], .n_new = n_new[r], .q_start = q_start[r], .p0 = kv_len[r] - n_new[r],
            .hq = hq, .hkv = hkv, .g = hq / hkv, .d = d, .scale = scale, .softcap = softcap,
            .window = window, .out = out, .out_stride = out_stride, .path = path,
            .kpack = scratch, .vrows = (const void **)((float *)scratch + blocks * KB * d),
            /* K as bf16 pairs fills half of each key's 4 d bytes of kpack: the V pairs take the rest */
            .vpairs = (uint32_t *)scratch + blocks * KB * (d / 2),
            /* where paged_attention's row items weigh with bf16 weights too (cpu_kernels.c), so
             * that a row gets (nearly always) the same weights in either kernel */
            .bf16_weights = path == PATH_BF16_DP && (d == 64 || d == 128) && hq <= BF16_ROW_MAX_HQ,
        };
        for (int64_t h = 0; h < hkv; h++) {
            jb.h = h;
            extend_head(&jb, (char *)scratch + packed, nthreads);
        }
    }
    return 0;
}
#else
#define EXTEND_BUILT 0
#endif

/* Which vector path was built: 0 none (no AVX2 + FMA: the caller uses its fallback), 8 AVX2, 16
 * AVX-512F, 32 AVX-512 BF16 (bf16 scores by vdpbf16ps). */
int extend_attention_isa(void) {
#if defined(__AVX512BF16__)
    return 32;
#elif EXTEND_BUILT
    return VL;
#else
    return 0;
#endif
}

/* Scratch bytes for requests of up to max_len kv positions on nthreads threads: one kv head's
 * packed K (and V pairs) and V row pointers, and each thread's item buffers. */
int64_t extend_attention_scratch_bytes(int64_t max_len, int64_t d, int nthreads) {
#if EXTEND_BUILT
    return pack_bytes(max_len, d) + nthreads * item_bytes(d);
#else
    (void)max_len, (void)d, (void)nthreads;
    return 0;
#endif
}

#if EXTEND_BUILT
#define DEFINE_EXTEND(NAME, PATH)                                                                   \
    int NAME(const void *q, int64_t q_stride, const void *k, const void *v, const int64_t *table,  \
             int64_t table_stride, int64_t n_req, const int64_t *req_row, const int64_t *q_start,   \
             const int64_t *n_new, const int64_t *kv_len, int64_t hq, int64_t hkv, int64_t d,       \
             float scale, int64_t window, float softcap, void *out, int64_t out_stride,            \
             void *scratch, int64_t scratch_bytes, int nthreads) {                                  \
        return extend_attention(PATH, q, q_stride, k, v, table, table_stride, n_req, req_row,      \
                                q_start, n_new, kv_len, hq, hkv, d, scale, window, softcap, out,   \
                                out_stride, scratch, scratch_bytes, nthreads);                      \
    }
#if defined(__AVX512BF16__)
DEFINE_EXTEND(extend_attention_bf16, PATH_BF16_DP)
#else
DEFINE_EXTEND(extend_attention_bf16, PATH_BF16_INPUT)
#endif
DEFINE_EXTEND(extend_attention_f32, PATH_F32)
#else
int extend_attention_bf16(void) { return -1; }
int extend_attention_f32(void) { return -1; }
#endif
