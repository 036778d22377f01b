/* Float32 linear y = x W^T + b on AVX2 CPUs, every row count, one summation order.
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
