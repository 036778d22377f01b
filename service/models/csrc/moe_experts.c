/* The routed experts of a mixture-of-experts layer on CPU, in bf16, in one call: the grouping
 * of (token, slot) pairs by expert, each active expert's gate_up matmul with silu(gate) * up,
 * its down matmul, and the weighted sum of a token's k expert outputs.
 *
 * Layouts (contiguous):
 *   x          [T, H]        the tokens' hidden rows
 *   ids        [T, k] int64  each token's experts (the router's top-k)
 *   weights    [T, k] f32    their routing weights
 *   w_gate_up  [E, 2I, H]    each expert's gate rows, then its up rows
 *   w_down     [E, H, I]
 *   out        [T, H]
 * Pair p = slot * T + token. The pairs are counting-sorted by expert (stably: slot, then token),
 * so an expert's rows are consecutive and each expert's weights are read once per call, however
 * many of its tokens there are; an expert no token chose is not read.
 *
 * Why not one torch matmul per expert: a decode step gives each active expert a handful of rows,
 * where a matmul is a weight stream; per call, oneDNN's or MKL's set-up and thread wake-ups cost
 * as much as streaming a 512 x 1024 bf16 weight. Here every expert's column blocks of both matmuls
 * are work items of one parallel region (two phases and a combine, split by barriers).
 *
 * Arithmetic (AVX-512 BF16, vdpbf16ps: bf16 pairs, float32 sums): gate and up are rounded to bf16
 * (a linear's output), act = bf16(bf16(silu(gate)) * up) as the silu_mul kernel, the down rows
 * rounded to bf16; a token's k outputs are weighted in float32 and summed in increasing expert order,
 * rounded to bf16 once. A row's results depend only on that row (the same tile code whatever the
 * rows around it): a token gets the same bits alone or in any batch.
 * Needs AVX-512 BF16 (moe_experts_isa() == 0: not built, the caller runs torch matmuls).
 */
#include <stdint.h>
#include <string.h>

#include "kernel_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#define MOE_CB 4         /* weight rows of a register tile (gate_up: 4 gate + 4 up rows) */
#define MOE_MAX_TOP_K 64 /* experts per token at most (published models: 2-10) */

static inline __m512bh load_pairs(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

/* Register tiles (at most 16 accumulators: AVX-512 has 32 registers): gate_up 2 rows x (4 gate +
 * 4 up) weight rows, down 4 rows x 4 weight rows, and one-row tiles for the rest.
 * acc[r][c] (float32) = sum over kk < K of a[r][kk] * b[c][kk]: NR rows of a, NC rows of b,
 * both bf16 rows of length K. The order of the sums depends on K only. */
#define DEFINE_TILE(NAME, NR, NC)                                                                  \
    static inline void NAME(const uint16_t *const *a, const uint16_t *const *b, int64_t K,         \
                            float acc[NR][NC], int64_t ahead) {                                    \
        __m512 s[NR][NC];                                                                          \
        for (int r = 0; r < NR; r++)                                                               \
            for (int c = 0; c < NC; c++) s[r][c] = _mm512_setzero_ps();                            \
        for (int64_t kk = 0; kk < K; kk += 32) {                                                   \
            const __mmask32 m = K - kk >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (K - kk)) - 1); \
            __m512bh bv[NC];                                                                       \
            for (int c = 0; c < NC; c++) {                                                         \
                bv[c] = load_pairs(b[c] + kk, m);                                                  \
                _mm_prefetch((const char *)(b[c] + kk + ahead), _MM_HINT_T0);                      \
            }                                                                                      \
            for (int r = 0; r < NR; r++) {                                                         \
                const __m512bh av = load_pairs(a[r] + kk, m);                                      \
                for (int c = 0; c < NC; c++) s[r][c] = _mm512_dpbf16_ps(s[r][c], av, bv[c]);       \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < NR; r++)                                                               \
            for (int c = 0; c < NC; c++) acc[r][c] = _mm512_reduce_add_ps(s[r][c]);                \
    }

DEFINE_TILE(tile_gu_2, 2, 2 * MOE_CB)
DEFINE_TILE(tile_gu_1, 1, 2 * MOE_CB)
DEFINE_TILE(tile_dn_4, 4, MOE_CB)
DEFINE_TILE(tile_dn_1, 1, MOE_CB)

static inline float silu_mul_one(float g, float u) {
    const float gb = bf16_to_f32(f32_to_bf16(g)); /* the gate_up linear's output, rounded */
    const float s = bf16_to_f32(f32_to_bf16(silu_f32(gb)));
    return s * bf16_to_f32(f32_to_bf16(u));
}

/* act rows [n, I] of one expert, columns c0 .. c0 + MOE_CB (fewer at the end). */
static void gate_up_block(const uint16_t *x, int64_t T, int64_t H, const int64_t *pair, int64_t n,
                          const uint16_t *w, int64_t I, int64_t c0, uint16_t *act) {
    const int64_t nc = I - c0 < MOE_CB ? I - c0 : MOE_CB;
    const uint16_t *b[2 * MOE_CB];
    for (int c = 0; c < MOE_CB; c++) { /* past the end: repeat the last column (results dropped) */
        const int64_t col = c0 + (c < nc ? c : nc - 1);
        b[c] = w + col * H;
        b[MOE_CB + c] = w + (I + col) * H;
    }
    int64_t r = 0;
    for (; r + 2 <= n; r += 2) {
        const uint16_t *a[2] = {x + pair[r] % T * H, x + pair[r + 1] % T * H}; /* pair -> its token's row */
        float acc[2][2 * MOE_CB];
        tile_gu_2(a, b, H, acc, MOE_CB * H);
        for (int i = 0; i < 2; i++)
            for (int c = 0; c < nc; c++) act[(r + i) * I + c0 + c] = f32_to_bf16(silu_mul_one(acc[i][c], acc[i][MOE_CB + c]));
    }
    for (; r < n; r++) {
        const uint16_t *a[1] = {x + pair[r] % T * H};
        float acc[1][2 * MOE_CB];
        tile_gu_1(a, b, H, acc, MOE_CB * H);
        for (int c = 0; c < nc; c++) act[r * I + c0 + c] = f32_to_bf16(silu_mul_one(acc[0][c], acc[0][MOE_CB + c]));
    }
}

/* y rows [n] (float32 holding bf16-rounded values, row stride H) of one expert, columns c0 .. c0 + MOE_CB. */
static void down_block(const uint16_t *act, int64_t I, int64_t n, const uint16_t *w, int64_t H, int64_t c0,
                       float *y, const int64_t *pair) {
    const int64_t nc = H - c0 < MOE_CB ? H - c0 : MOE_CB;
    const uint16_t *b[MOE_CB];
    for (int c = 0; c < MOE_CB; c++) b[c] = w + (c0 + (c < nc ? c : nc - 1)) * I;
    int64_t r = 0;
    for (; r + 4 <= n; r += 4) {
        const uint16_t *a[4] = {act + r * I, act + (r + 1) * I, act + (r + 2) * I, act + (r + 3) * I};
        float acc[4][MOE_CB];
        tile_dn_4(a, b, I, acc, MOE_CB * I);
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < nc; c++) y[pair[r + i] * H + c0 + c] = bf16_to_f32(f32_to_bf16(acc[i][c]));
    }
    for (; r < n; r++) {
        const uint16_t *a[1] = {act + r * I};
        float acc[1][MOE_CB];
        tile_dn_1(a, b, I, acc, MOE_CB * I);
        for (int c = 0; c < nc; c++) y[pair[r] * H + c0 + c] = bf16_to_f32(f32_to_bf16(acc[0][c]));
    }
}

/* Scratch: the sorted pairs, each expert's first sorted pair, the sort's cursors, act [P, I] bf16,
 * y [P, H] float32 (indexed by pair). */
int64_t moe_experts_scratch_bytes(int64_t T, int64_t k, int64_t E, int64_t H, int64_t I) {
    const int64_t P = T * k;
    return P * 8 + (2 * E + 1) * 8 + P * I * 2 + P * H * 4 + 64;
}

int moe_experts_bf16(const uint16_t *x, int64_t T, int64_t H, const int64_t *ids, const float *weights,
                     int64_t k, const uint16_t *w_gate_up, const uint16_t *w_down, int64_t E, int64_t I,
                     uint16_t *out, void *scratch, int64_t scratch_bytes, int nthreads) {
    const int64_t P = T * k;
    if (scratch_bytes < moe_experts_scratch_bytes(T, k, E, H, I) || T <= 0 || k <= 0) return -1;
    if (k > MOE_MAX_TOP_K) return -4;
    for (int64_t i = 0; i < P; i++)
        if (ids[i] < 0 || ids[i] >= E) return -2;
    int64_t *order = (int64_t *)scratch; /* sorted position -> pair */
    int64_t *start = order + P;          /* [E + 1] */
    int64_t *fill = start + E + 1;       /* [E] cursors of the sort */
    uint16_t *act = (uint16_t *)(fill + E);
    float *y = (float *)(((uintptr_t)(act + P * I) + 63) & ~(uintptr_t)63);

    /* counting sort by expert, stable in pair order (slot-major) */
    memset(start, 0, (E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < P; i++) start[ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, E * sizeof(int64_t));
    for (int64_t s = 0; s < k; s++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t at = fill[ids[t * k + s]]++;
            order[at] = s * T + t;
        }
    int64_t active[E > 0 ? E : 1], n_active = 0;
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e]) active[n_active++] = e;
    const int64_t gu_blocks = (I + MOE_CB - 1) / MOE_CB, dn_blocks = (H + MOE_CB - 1) / MOE_CB;

    _Pragma("omp parallel num_threads(nthreads)") {
        _Pragma("omp for schedule(static)")
        for (int64_t it = 0; it < n_active * gu_blocks; it++) {
            const int64_t e = active[it / gu_blocks], s0 = start[e];
            gate_up_block(x, T, H, order + s0, start[e + 1] - s0, w_gate_up + e * 2 * I * H, I,
                          (it % gu_blocks) * MOE_CB, act + s0 * I);
        }
        _Pragma("omp for schedule(static)")
        for (int64_t it = 0; it < n_active * dn_blocks; it++) {
            const int64_t e = active[it / dn_blocks], s0 = start[e];
            down_block(act + s0 * I, I, start[e + 1] - s0, w_down + e * H * I, H, (it % dn_blocks) * MOE_CB, y,
                       order + s0);
        }
        _Pragma("omp for schedule(static)")
        for (int64_t t = 0; t < T; t++) {
            int64_t slot[MOE_MAX_TOP_K]; /* this token's slots by increasing expert */
            const int64_t kk = k;
            for (int64_t s = 0; s < kk; s++) {
                int64_t j = s;
                while (j > 0 && ids[t * k + slot[j - 1]] > ids[t * k + s]) { slot[j] = slot[j - 1]; j--; }
                slot[j] = s;
            }
            uint16_t *o = out + t * H;
            for (int64_t c = 0; c < H; c += 16) {
                const __mmask16 m = H - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - c)) - 1);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t s = 0; s < kk; s++) {
                    const int64_t p = slot[s] * T + t;
                    sum = _mm512_fmadd_ps(_mm512_set1_ps(weights[t * k + slot[s]]),
                                          _mm512_maskz_loadu_ps(m, y + p * H + c), sum);
                }
                _mm256_mask_storeu_epi16(o + c, m, (__m256i)_mm512_cvtneps_pbh(sum));
            }
        }
    }
    return 0;
}

int moe_experts_isa(void) { return 32; }

#else
int64_t moe_experts_scratch_bytes(int64_t T, int64_t k, int64_t E, int64_t H, int64_t I) {
    (void)T, (void)k, (void)E, (void)H, (void)I;
    return 0;
}
int moe_experts_bf16(const uint16_t *x, int64_t T, int64_t H, const int64_t *ids, const float *weights,
                     int64_t k, const uint16_t *w_gate_up, const uint16_t *w_down, int64_t E, int64_t I,
                     uint16_t *out, void *scratch, int64_t scratch_bytes, int nthreads) {
    (void)x, (void)T, (void)H, (void)ids, (void)weights, (void)k, (void)w_gate_up, (void)w_down, (void)E;
    (void)I, (void)out, (void)scratch, (void)scratch_bytes, (void)nthreads;
    return -3;
}
int moe_experts_isa(void) { return 0; }
#endif
