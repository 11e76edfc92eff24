/* A decode step (one new token for each of `rows` sequences) through every layer of a
 * Llama-shaped decoder in one call: per layer, RMSNorm + fused q/k/v matmul, rope + cache
 * write + attention over the paged cache, o projection, residual add, RMSNorm + fused gate/up
 * matmul, silu(gate) * up + down projection, residual add.
 *
 * It runs the very kernels the per-layer Python path calls (nbq_*_matmul from
 * quant_matmul.c, nbq_paged_decode_step from paged_attention.c) on the same inputs, and adds
 * the residuals as torch does (one float32 addition each), so its hidden states are bit for
 * bit the Python path's; what it removes is the Python and op dispatch between the kernels,
 * a large share of a small model's step outside the matmuls.
 *
 * Every layer's weights are described once by an nbq_layer (nbserve_kernels.h;
 * nbserve/models/decode_stack.py builds the array); the step's inputs are the hidden states x
 * (rows x hidden floats, updated in place), each row's position and block table row
 * (tables + r * table_stride), and each row's rope row (cos, sin_signed: rows x d) that all
 * layers share. `spent`, when not NULL,
 * gets the seconds of the matmuls and of the attention calls added to spent[0] and spent[1]
 * (benchmarks/step_split.py). Returns 0, -1 when out of memory, -2 for invalid arguments
 * (shapes that do not fit, the attention kernel's checks); x is then unspecified.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nbserve_kernels.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Whether w is a weight of n outputs of k inputs, its parts (NBQ_PARTS) each one of k inputs
 * and of another kind whose outputs sum to n; *widest grows to its widest part's outputs. */
static int fits(const nbq_weight *w, int n, int k, int *widest) {
    if (w->n != n || w->k != k) return 0;
    if (w->kind != NBQ_PARTS) return 1;
    if (w->parts <= 0 || !w->part) return 0;
    long sum = 0;
    for (int p = 0; p < w->parts; p++) {
        const nbq_weight *part = w->part + p;
        if (part->kind == NBQ_PARTS || part->k != k || part->n <= 0) return 0;
        sum += part->n;
        *widest = part->n > *widest ? part->n : *widest;
    }
    return sum == n;
}

/* y = w @ prepare(x) for `rows` input rows (norm / gated as in quant_matmul.c); the parts of
 * an NBQ_PARTS weight each into its columns of y (rows, n), one row straight into place, more
 * through `scratch` (rows x its widest part): what the per-layer path's concatenation gives */
static int project(const nbq_weight *w, const float *x, int rows, float *y, float *scratch,
                   int threads, const float *norm, float eps, int gated) {
    int flags = w->flags | gated;  /* gated: 0 or NBQ_GATED */
    if (w->kind == NBQ_PARTS) {
        int column = 0;
        for (int p = 0; p < w->parts; p++) {
            const nbq_weight *part = w->part + p;
            float *into = rows == 1 ? y + column : scratch;
            int failed = project(part, x, rows, into, NULL, threads, norm, eps, gated);
            if (failed) return failed;
            if (rows > 1)
                for (int r = 0; r < rows; r++)
                    memcpy(y + (size_t)r * w->n + column, scratch + (size_t)r * part->n,
                           sizeof(float) * (size_t)part->n);
            column += part->n;
        }
        return 0;
    }
    switch (w->kind) {
    case NBQ_Q4:
        return nbq_q4_matmul(x, rows, w->k, w->codes, w->d, w->m, w->n, y, threads, norm, eps,
                             flags);
    case NBQ_Q8:
        return nbq_q8_matmul(x, rows, w->k, w->codes, w->d, w->n, y, threads, norm, eps,
                             flags);
    case NBQ_F32:
        return nbq_f32_matmul(x, rows, w->k, w->codes, w->n, y, threads, norm, eps, flags);
    case NBQ_BLOCKS:
        return nbq_blocks_matmul(x, rows, w->k, w->block_type, w->codes, w->n, y, threads, norm,
                                 eps, flags);
    default:
        return -2;
    }
}

int nbq_decode_stack(const nbq_layer *layers, int n_layers, int rows, int hidden, int hq,
                     int hkv, int d, float eps, int kv_f16, int block_size,
                     const int32_t *tables, int table_stride, const int32_t *positions,
                     const float *cos, const float *sin_signed, float *x, int threads,
                     double *spent) {
    if (n_layers < 0 || rows < 0 || hidden <= 0 || hq <= 0 || hkv <= 0 || d <= 0) return -2;
    if (rows == 0) return 0;
    const int qkv_width = (hq + 2 * hkv) * d;
    int width = qkv_width;  /* the widest output a layer writes: q/k/v or gate/up */
    int widest = 0;         /* the widest part of an NBQ_PARTS weight (0: none) */
    for (int l = 0; l < n_layers; l++) {
        const nbq_layer *L = layers + l;
        const int ffn = L->down.k;
        if (!fits(&L->qkv, qkv_width, hidden, &widest) ||
            !fits(&L->o, hidden, hq * d, &widest) ||
            !fits(&L->gate_up, 2 * ffn, hidden, &widest) ||
            !fits(&L->down, hidden, ffn, &widest))
            return -2;
        width = L->gate_up.n > width ? L->gate_up.n : width;
    }
    const size_t cells = (size_t)rows * hidden;
    float *wide = malloc(sizeof(float) * (size_t)rows * width);
    float *attn = malloc(sizeof(float) * (size_t)rows * hq * d);
    float *h = malloc(sizeof(float) * cells);
    float *scratch = rows > 1 && widest ? malloc(sizeof(float) * (size_t)rows * widest) : NULL;
    int failed = !wide || !attn || !h || (rows > 1 && widest && !scratch) ? -1 : 0;
    double t0 = spent ? now() : 0, t1;
    for (int l = 0; l < n_layers && !failed; l++) {
        const nbq_layer *L = layers + l;
        failed = project(&L->qkv, x, rows, wide, scratch, threads, L->attn_norm, eps, 0);
        if (spent) { t1 = now(); spent[0] += t1 - t0; t0 = t1; }
        if (failed) break;
        failed = kv_f16
            ? nbq_paged_decode_step_f16(wide, rows, hq, hkv, d, cos, sin_signed, L->keys,
                                        L->values, block_size, tables, table_stride,
                                        positions, attn, threads)
            : nbq_paged_decode_step(wide, rows, hq, hkv, d, cos, sin_signed, L->keys,
                                    L->values, block_size, tables, table_stride, positions,
                                    attn, threads);
        if (spent) { t1 = now(); spent[1] += t1 - t0; t0 = t1; }
        if (failed) break;
        failed = project(&L->o, attn, rows, h, scratch, threads, NULL, 0.f, 0);
        if (failed) break;
        for (size_t j = 0; j < cells; j++) x[j] = x[j] + h[j];
        failed = project(&L->gate_up, x, rows, wide, scratch, threads, L->mlp_norm, eps, 0);
        if (failed) break;
        failed = project(&L->down, wide, rows, h, scratch, threads, NULL, 0.f, NBQ_GATED);
        if (failed) break;
        for (size_t j = 0; j < cells; j++) x[j] = x[j] + h[j];
        if (spent) { t1 = now(); spent[0] += t1 - t0; t0 = t1; }  /* with the residual adds */
    }
    free(wide);
    free(attn);
    free(h);
    free(scratch);
    return failed;
}
