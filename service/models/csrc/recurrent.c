/* The gated delta rule (Gated DeltaNet: service/models/gated_delta.py) token by token, in place on
 * the slots' states: a decode step and the prompt tokens of an extend batch alike.
 *
 * Layouts (all contiguous, float32), m requests right-padded to L tokens each (a decode: L = 1):
 *   q, k     [m, L, kheads, dk]   q scaled and both L2-normalised; v head h reads q/k head
 *                                 h / (vheads / kheads)
 *   v        [m, L, vheads, dv]
 *   g, beta  [m, L, vheads]       the log decay and the update's strength
 *   states   [slots, vheads, dk, dv]
 *   slots    [m] int64            request i's state row; keep[i] == 0 (keep may be NULL: all 1):
 *                                 it starts from zeros
 *   lens     [m] int64            request i's tokens (NULL: all L); its padding is not read
 *   out      [m, L, vheads, dv]   written at the real tokens only
 *
 * Per token and head, as the torch form computes it (recurrent_step; the chunked form is the same
 * recurrence regrouped):
 *   S = e^g S;  S += k (beta (v - k^T S))^T;  o = q^T S
 * Work items are (request, head), each running its tokens in order. A state (dk x dv, 64 KiB at
 * 128 x 128) stays in L1/L2 across them and is read and written once per token: the pass that
 * updates S for token t and sums o_t also sums token t+1's k^T (e^g S). Per token that is 3 dk dv
 * multiply-adds, against the chunked form's ~5 dk dv per token in small matmuls and a triangular
 * solve (torch, CHUNK = 64). Sums over dk run in order, so results differ from torch's einsums and
 * matmuls by float32 rounding; and a request's results do not depend on its batch, nor on where
 * its prompt was cut into chunks. OpenMP threads come from the runtime torch loaded (libgomp).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "kernel_math.h"

#define GD_MAX_DV 512

/* Work item helpers shared by the kernels below: request i's token count (lens may be NULL: all L),
 * and its slot's state for the item (`size` floats at `offset` within the slot's `row` floats),
 * zeroed where the request starts afresh (keep may be NULL: all continue). */
static inline int64_t item_tokens(const int64_t *lens, int64_t i, int64_t L) { return lens ? lens[i] : L; }

static inline float *item_state(float *states, const int64_t *slots, const uint8_t *keep, int64_t i,
                                int64_t row, int64_t offset, int64_t size) {
    float *S = states + slots[i] * row + offset;
    if (keep && !keep[i]) memset(S, 0, (size_t)size * sizeof(float));
    return S;
}

int gated_delta_rule_f32(const float *q, const float *k, const float *v, const float *g,
                         const float *beta, float *states, const int64_t *slots, const uint8_t *keep,
                         const int64_t *lens, float *out, int64_t m, int64_t L, int64_t kheads,
                         int64_t vheads, int64_t dk, int64_t dv, int nthreads) {
    if (dv > GD_MAX_DV || kheads <= 0 || vheads % kheads) return -1;
    const int64_t group = vheads / kheads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t item = 0; item < m * vheads; item++) {
        const int64_t i = item / vheads, h = item % vheads, kh = h / group;
        const int64_t n = item_tokens(lens, i, L);
        float pred[GD_MAX_DV], next[GD_MAX_DV], delta[GD_MAX_DV], o[GD_MAX_DV];
        if (n <= 0) continue;
        float *S = item_state(states, slots, keep, i, vheads * dk * dv, h * dk * dv, dk * dv);
#define TOKEN(t) ((i * L + (t)))
        { /* the first token's predicted value: k^T (e^g S) */
            const float *k0 = k + (TOKEN(0) * kheads + kh) * dk;
            const float d0 = expf(g[TOKEN(0) * vheads + h]);
            for (int64_t e = 0; e < dv; e++) pred[e] = 0.f;
            for (int64_t kk = 0; kk < dk; kk++) {
                const float kv = k0[kk];
                const float *row = S + kk * dv;
#pragma omp simd
                for (int64_t e = 0; e < dv; e++) pred[e] += kv * (row[e] * d0);
            }
        }
        for (int64_t t = 0; t < n; t++) {
            const int64_t r = TOKEN(t);
            const float *qt = q + (r * kheads + kh) * dk, *kt = k + (r * kheads + kh) * dk;
            const float *vt = v + (r * vheads + h) * dv;
            const float d = expf(g[r * vheads + h]), b = beta[r * vheads + h];
#pragma omp simd
            for (int64_t e = 0; e < dv; e++) {
                delta[e] = (vt[e] - pred[e]) * b;
                o[e] = 0.f;
                next[e] = 0.f;
            }
            if (t + 1 < n) { /* S' = e^g S + k delta^T; o = q^T S'; the next token's k^T (e^g' S') */
                const float *kn = k + ((r + 1) * kheads + kh) * dk;
                const float dn = expf(g[(r + 1) * vheads + h]);
                for (int64_t kk = 0; kk < dk; kk++) {
                    const float kv = kt[kk], qv = qt[kk], knv = kn[kk];
                    float *row = S + kk * dv;
#pragma omp simd
                    for (int64_t e = 0; e < dv; e++) {
                        const float s = row[e] * d + kv * delta[e];
                        row[e] = s;
                        o[e] += qv * s;
                        next[e] += knv * (s * dn);
                    }
                }
            } else {
                for (int64_t kk = 0; kk < dk; kk++) {
                    const float kv = kt[kk], qv = qt[kk];
                    float *row = S + kk * dv;
#pragma omp simd
                    for (int64_t e = 0; e < dv; e++) {
                        const float s = row[e] * d + kv * delta[e];
                        row[e] = s;
                        o[e] += qv * s;
                    }
                }
            }
            memcpy(out + (r * vheads + h) * dv, o, (size_t)dv * sizeof(float));
            memcpy(pred, next, (size_t)dv * sizeof(float));
        }
#undef TOKEN
    }
    return 0;
}

/* Mamba-2's selective scan (service/models/mamba2.py) token by token, in place on the slots' states.
 *
 * Layouts (all contiguous, float32), m requests right-padded to L tokens each (a decode: L = 1):
 *   x        [m, L, heads, p]
 *   dt       [m, L, heads]        after softplus (and the chunked form's clamp, where it applies)
 *   a        [heads]              A = -exp(A_log)
 *   b, c     [m, L, groups, n]    head h reads group h / (heads / groups)
 *   states   [slots, heads, p, n]
 *   slots, keep, lens             as gated_delta_rule_f32's
 *   y        [m, L, heads, p]     S C per real token (the caller adds D x)
 *
 * Per token and head, as ssm_step computes it: S = e^(dt a) S + (dt x) b^T;  y = S c. One pass over
 * S per token, the state in L1/L2 across the item's tokens. The sum over n is vectorised (its order
 * is fixed: a request's results do not depend on its batch nor on its chunks).
 */
int ssm_scan_f32(const float *x, const float *dt, const float *a, const float *b, const float *c,
                 float *states, const int64_t *slots, const uint8_t *keep, const int64_t *lens,
                 float *y, int64_t m, int64_t L, int64_t heads, int64_t groups, int64_t p, int64_t n,
                 int nthreads) {
    if (groups <= 0 || heads % groups) return -1;
    const int64_t per = heads / groups;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t item = 0; item < m * heads; item++) {
        const int64_t i = item / heads, h = item % heads, gr = h / per;
        const int64_t tokens = item_tokens(lens, i, L);
        if (tokens <= 0) continue;
        float *S = item_state(states, slots, keep, i, heads * p * n, h * p * n, p * n);
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t r = i * L + t;
            const float step = dt[r * heads + h];
            const float decay = expf(step * a[h]);
            const float *xt = x + (r * heads + h) * p;
            const float *bt = b + (r * groups + gr) * n, *ct = c + (r * groups + gr) * n;
            float *yt = y + (r * heads + h) * p;
            for (int64_t pp = 0; pp < p; pp++) {
                const float u = step * xt[pp];
                float *row = S + pp * n;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t e = 0; e < n; e++) {
                    const float s = row[e] * decay + u * bt[e];
                    row[e] = s;
                    acc += s * ct[e];
                }
                yt[pp] = acc;
            }
        }
    }
    return 0;
}

/* Mamba-1's selective scan (service/models/mamba1.py) token by token, in place on the slots' states.
 *
 * Layouts (all contiguous, float32), m requests right-padded to L tokens each (a decode: L = 1):
 *   u, dt    [m, L, d]            the conv's output and the step (after softplus)
 *   a        [d, n]               A = -exp(A_log): a decay per channel and state
 *   b, c     [m, L, n]
 *   states   [slots, d, n]
 *   slots, keep, lens             as gated_delta_rule_f32's
 *   y        [m, L, d]            S c per real token (the caller adds D u)
 *
 * Per token and channel, as ssm_step computes it: S = exp(dt a) S + (dt u) b^T;  y = S c. The decay
 * differs per channel and state, so no chunk condenses into matmuls: the torch form loops over the
 * tokens, several ops each. Work items are (request, block of SSM1_BLOCK channels), the block's
 * states (SSM1_BLOCK x n) in L1 across the item's tokens. exp is exp_approx (relative ~2e-7).
 */
#define SSM1_BLOCK 64

int ssm1_scan_f32(const float *u, const float *dt, const float *a, const float *b, const float *c,
                  float *states, const int64_t *slots, const uint8_t *keep, const int64_t *lens,
                  float *y, int64_t m, int64_t L, int64_t d, int64_t n, int nthreads) {
    const int64_t blocks = (d + SSM1_BLOCK - 1) / SSM1_BLOCK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t item = 0; item < m * blocks; item++) {
        const int64_t i = item / blocks, d0 = (item % blocks) * SSM1_BLOCK;
        const int64_t d1 = d0 + SSM1_BLOCK < d ? d0 + SSM1_BLOCK : d;
        const int64_t tokens = item_tokens(lens, i, L);
        if (tokens <= 0) continue;
        float *S = item_state(states, slots, keep, i, d * n, d0 * n, (d1 - d0) * n); /* channels d0.. */
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t r = i * L + t;
            const float *bt = b + r * n, *ct = c + r * n;
            for (int64_t ch = d0; ch < d1; ch++) {
                const float step = dt[r * d + ch], x = step * u[r * d + ch];
                const float *ach = a + ch * n;
                float *row = S + (ch - d0) * n;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t e = 0; e < n; e++) {
                    const float s = row[e] * exp_approx(step * ach[e]) + x * bt[e];
                    row[e] = s;
                    acc += s * ct[e];
                }
                y[r * d + ch] = acc;
            }
        }
    }
    return 0;
}
