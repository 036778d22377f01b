/* Linear y = x W^T + b through weights laid out once in panels, every row count, one summation
 * order: float32 on AVX2 CPUs, bf16 on CPUs with AVX-512 BF16 (second half of this file).
 *
 * W is laid out once in panels of 16 output rows, panels[p][k][j] = W[16p + j][k] (zero past N).
 * A tile of up to 6 x rows by one panel keeps its 12 accumulators in registers (named: the
 * compiler keeps them there), each k one broadcast of x per row and two loads of the panel. The
 * rows run in blocks of PANEL_BLOCK (a block of x stays in cache while every panel streams past
 * it once), the threads split each block's panels.
 *
 * Every output is its bias plus the terms summed over k in order, one FMA per term, whatever tile
 * or block its row falls in: a row's results are the same bits alone and in any batch (oneDNN's
 * kernels sum in an order that depends on the row count). At 1-32 rows this streams the weights
 * 1.3-2x faster than oneDNN's packed kernels, from 64 rows on it runs at their speed
 * (docs/benchmarks.md, "Float32 linears in one order on AVX2").
 */
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define PANEL_ROWS 6    /* x rows per tile */
#define PANEL_BLOCK 48  /* x rows per block */

void pack_panels_f32(const float *w, int64_t n, int64_t k, float *panels) {
    const int64_t np = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < np; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < PANEL; j++) {
                const int64_t row = p * PANEL + j;
                panels[(p * k + kk) * PANEL + j] = row < n ? w[row * k + kk] : 0.f;
            }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#define ACC_ROW(MT, A)                                               \
    if (MT > A) {                                                    \
        const __m256 xb = _mm256_broadcast_ss(x + A * ldx + kk);     \
        c##A##0 = _mm256_fmadd_ps(xb, w0, c##A##0);                  \
        c##A##1 = _mm256_fmadd_ps(xb, w1, c##A##1);                  \
    }
#define OUT_ROW(MT, A)             \
    if (MT > A) {                  \
        out[2 * A] = c##A##0;      \
        out[2 * A + 1] = c##A##1;  \
    }
#define DEFINE_PANEL_TILE(MT)                                                                                     \
    static void panel_tile_##MT(const float *x, int64_t ldx, const float *panel, int64_t k, __m256 *out) {       \
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;                \
        __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;                                \
        for (int64_t kk = 0; kk < k; kk++) {                                                                      \
            const __m256 w0 = _mm256_loadu_ps(panel + kk * PANEL), w1 = _mm256_loadu_ps(panel + kk * PANEL + 8); \
            ACC_ROW(MT, 0) ACC_ROW(MT, 1) ACC_ROW(MT, 2) ACC_ROW(MT, 3) ACC_ROW(MT, 4) ACC_ROW(MT, 5)            \
        }                                                                                                         \
        OUT_ROW(MT, 0) OUT_ROW(MT, 1) OUT_ROW(MT, 2) OUT_ROW(MT, 3) OUT_ROW(MT, 4) OUT_ROW(MT, 5)                \
    }
DEFINE_PANEL_TILE(1)
DEFINE_PANEL_TILE(2)
DEFINE_PANEL_TILE(3)
DEFINE_PANEL_TILE(4)
DEFINE_PANEL_TILE(5)
DEFINE_PANEL_TILE(6)
typedef void (*panel_tile_fn)(const float *, int64_t, const float *, int64_t, __m256 *);
static const panel_tile_fn PANEL_TILES[PANEL_ROWS + 1] = {
    0, panel_tile_1, panel_tile_2, panel_tile_3, panel_tile_4, panel_tile_5, panel_tile_6};

/* Rows m0 .. m1-1 of y times panel p (output columns n0 .. n0+15). */
static void panel_rows(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, const float *panel,
                       int64_t n, int64_t n0, const float *bias, float *y) {
    const int64_t nn = n - n0 < PANEL ? n - n0 : PANEL;
    float b[PANEL] = {0};
    if (bias) memcpy(b, bias + n0, nn * sizeof(float));
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    for (int64_t r = m0; r < m1; r += PANEL_ROWS) {
        const int mt = m1 - r < PANEL_ROWS ? (int)(m1 - r) : PANEL_ROWS;
        __m256 out[2 * PANEL_ROWS];
        PANEL_TILES[mt](x + r * ldx, ldx, panel, k, out);
        for (int a = 0; a < mt; a++) {
            float row[PANEL];
            _mm256_storeu_ps(row, _mm256_add_ps(out[2 * a], b0));
            _mm256_storeu_ps(row + 8, _mm256_add_ps(out[2 * a + 1], b1));
            memcpy(y + (r + a) * n + n0, row, nn * sizeof(float));
        }
    }
}

int panel_linear_isa(void) { return 8; } /* built: AVX2 + FMA */

/* 0 when it ran; -1 when this build has no AVX2 + FMA (the caller uses another path). */
int panel_linear_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const float *panels, int64_t n,
                     const float *bias, float *y, int nthreads) {
    const int64_t np = (n + PANEL - 1) / PANEL;
    _Pragma("omp parallel num_threads(nthreads)") {
        for (int64_t m0 = 0; m0 < m; m0 += PANEL_BLOCK) {
            const int64_t m1 = m - m0 < PANEL_BLOCK ? m : m0 + PANEL_BLOCK;
            /* the same panels to the same thread in every block: no barrier between blocks */
            _Pragma("omp for schedule(static) nowait")
            for (int64_t p = 0; p < np; p++)
                panel_rows(x, ldx, m0, m1, k, panels + p * k * PANEL, n, p * PANEL, bias, y);
        }
    }
    return 0;
}
#else
int panel_linear_isa(void) { return 0; } /* not built: the caller keeps oneDNN */

int panel_linear_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const float *panels, int64_t n,
                     const float *bias, float *y, int nthreads) {
    (void)x, (void)ldx, (void)m, (void)k, (void)panels, (void)n, (void)bias, (void)y, (void)nthreads;
    return -1;
}
#endif

/* bf16: W laid out in panels of 32 output rows by k pairs, panels[p][k/2][j][2] = W[32p + j][k..k+1]
 * (zero past N; K even), so one 64-byte load holds one k pair of 16 outputs, what `vdpbf16ps`
 * takes. A tile of up to 8 x rows by one panel keeps 16 float32 accumulators in registers, each k
 * pair one broadcast of x per row; the panel is prefetched BF16_PREFETCH bytes ahead (the weights
 * stream from memory at decode sizes). Every output is the k pairs' products summed in order in
 * float32, plus its bias, rounded once to bf16 (to nearest even, as oneDNN): a row's results do
 * not depend on its batch. At 1-3 rows on one Zen 4 core this streams the weights 1.8-1.9x faster
 * than oneDNN's packed kernels, 1.5x at 8 rows, 1.1x at 16-32, even from 64 on (docs/benchmarks.md). */
#define BF16_PANEL 32
#define BF16_ROWS 8
#define BF16_BLOCK 48
#define BF16_PREFETCH 2048

void pack_panels_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *panels) {
    const int64_t np = (n + BF16_PANEL - 1) / BF16_PANEL, kp = k / 2;
    for (int64_t p = 0; p < np; p++)
        for (int64_t q = 0; q < kp; q++)
            for (int64_t j = 0; j < BF16_PANEL; j++) {
                const int64_t row = p * BF16_PANEL + j;
                uint16_t *dst = panels + ((p * kp + q) * BF16_PANEL + j) * 2;
                dst[0] = row < n ? w[row * k + 2 * q] : 0;
                dst[1] = row < n ? w[row * k + 2 * q + 1] : 0;
            }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <omp.h>

#define BF_ACC_ROW(MT, A)                                                                    \
    if (MT > A) {                                                                            \
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + A * ldx + 2 * q)); \
        c##A##0 = _mm512_dpbf16_ps(c##A##0, xb, w0);                                         \
        c##A##1 = _mm512_dpbf16_ps(c##A##1, xb, w1);                                         \
    }
#define BF_OUT_ROW(MT, A)          \
    if (MT > A) {                  \
        out[2 * A] = c##A##0;      \
        out[2 * A + 1] = c##A##1;  \
    }
#define DEFINE_BF16_TILE(MT)                                                                                  \
    static void bf16_tile_##MT(const uint16_t *x, int64_t ldx, const uint16_t *panel, int64_t kp, __m512 *out) { \
        __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00;   \
        __m512 c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00;         \
        __m512 c71 = c00;                                                                                     \
        for (int64_t q = 0; q < kp; q++) {                                                                    \
            const uint16_t *wq = panel + q * 2 * BF16_PANEL;                                                  \
            _mm_prefetch((const char *)wq + BF16_PREFETCH, _MM_HINT_T0);                                      \
            _mm_prefetch((const char *)wq + BF16_PREFETCH + 64, _MM_HINT_T0);                                 \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wq), w1 = (__m512bh)_mm512_loadu_si512(wq + 32); \
            BF_ACC_ROW(MT, 0) BF_ACC_ROW(MT, 1) BF_ACC_ROW(MT, 2) BF_ACC_ROW(MT, 3)                           \
            BF_ACC_ROW(MT, 4) BF_ACC_ROW(MT, 5) BF_ACC_ROW(MT, 6) BF_ACC_ROW(MT, 7)                           \
        }                                                                                                     \
        BF_OUT_ROW(MT, 0) BF_OUT_ROW(MT, 1) BF_OUT_ROW(MT, 2) BF_OUT_ROW(MT, 3)                               \
        BF_OUT_ROW(MT, 4) BF_OUT_ROW(MT, 5) BF_OUT_ROW(MT, 6) BF_OUT_ROW(MT, 7)                               \
    }
DEFINE_BF16_TILE(1)
DEFINE_BF16_TILE(2)
DEFINE_BF16_TILE(3)
DEFINE_BF16_TILE(4)
DEFINE_BF16_TILE(5)
DEFINE_BF16_TILE(6)
DEFINE_BF16_TILE(7)
DEFINE_BF16_TILE(8)
typedef void (*bf16_tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, __m512 *);
static const bf16_tile_fn BF16_TILES[BF16_ROWS + 1] = {0, bf16_tile_1, bf16_tile_2, bf16_tile_3, bf16_tile_4,
                                                       bf16_tile_5, bf16_tile_6, bf16_tile_7, bf16_tile_8};

/* Rows m0 .. m1-1 of y times panel p (output columns n0 .. n0+31). */
static void bf16_panel_rows(const uint16_t *x, int64_t ldx, int64_t m0, int64_t m1, int64_t kp,
                            const uint16_t *panel, int64_t n, int64_t n0, const float *bias, uint16_t *y) {
    const int64_t nn = n - n0 < BF16_PANEL ? n - n0 : BF16_PANEL;
    float b[BF16_PANEL] = {0};
    if (bias) memcpy(b, bias + n0, nn * sizeof(float));
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
    const __mmask16 k0 = nn >= 16 ? 0xffff : (__mmask16)((1u << nn) - 1);
    const __mmask16 k1 = nn >= 32 ? 0xffff : nn <= 16 ? 0 : (__mmask16)((1u << (nn - 16)) - 1);
    for (int64_t r = m0; r < m1; r += BF16_ROWS) {
        const int mt = m1 - r < BF16_ROWS ? (int)(m1 - r) : BF16_ROWS;
        __m512 out[2 * BF16_ROWS];
        BF16_TILES[mt](x + r * ldx, ldx, panel, kp, out);
        for (int a = 0; a < mt; a++) {
            uint16_t *dst = y + (r + a) * n + n0;
            _mm256_mask_storeu_epi16(dst, k0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(out[2 * a], b0)));
            _mm256_mask_storeu_epi16(dst + 16, k1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(out[2 * a + 1], b1)));
        }
    }
}

int panel_linear_bf16_isa(void) { return 16; } /* built: AVX-512 BF16 */

/* 0 when it ran; -1 when this build has no AVX-512 BF16 (the caller uses another path). */
int panel_linear_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *panels, int64_t n,
                      const float *bias, uint16_t *y, int nthreads) {
    const int64_t np = (n + BF16_PANEL - 1) / BF16_PANEL, kp = k / 2;
    _Pragma("omp parallel num_threads(nthreads)") {
        for (int64_t m0 = 0; m0 < m; m0 += BF16_BLOCK) {
            const int64_t m1 = m - m0 < BF16_BLOCK ? m : m0 + BF16_BLOCK;
            _Pragma("omp for schedule(static) nowait")
            for (int64_t p = 0; p < np; p++)
                bf16_panel_rows(x, ldx, m0, m1, kp, panels + p * kp * 2 * BF16_PANEL, n, p * BF16_PANEL, bias, y);
        }
    }
    return 0;
}
#else
int panel_linear_bf16_isa(void) { return 0; } /* not built: the caller keeps oneDNN */

int panel_linear_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *panels, int64_t n,
                      const float *bias, uint16_t *y, int nthreads) {
    (void)x, (void)ldx, (void)m, (void)k, (void)panels, (void)n, (void)bias, (void)y, (void)nthreads;
    return -1;
}
#endif
