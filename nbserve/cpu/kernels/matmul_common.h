/* What the matmul sources share (quant_matmul.c, gguf_blocks.c): float16 reading, the
 * input preparation folded into a call (RMSNorm, SwiGLU), and the panels that multiply
 * many input rows by weight rows dequantized to float32. Static functions, included by each
 * source; nothing here is exported. */
#ifndef NBSERVE_MATMUL_COMMON_H
#define NBSERVE_MATMUL_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "nbserve_kernels.h"

#define INLINE static inline __attribute__((always_inline))
#define ROW_PATH_MAX 8  /* inputs of up to this many rows take the row kernels (measured
                          faster there), more take the panels below */

/* A float16 as float32 (exact: every float16 is a float32). */
INLINE float h2f(half_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 */
        float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    bits = exp == 31 ? (sign | 0x7F800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* The input the product reads: x (R, K) itself; or x normalised, RMSNorm with weight `norm`
 * (as torch: x * rsqrt(mean(x^2) + eps), then * norm); or, `gated`, silu(a) * b for x (R, 2K) =
 * [a | b] (a SwiGLU MLP's gate and up). Returns x, or `*buf` (allocated, R * K floats; NULL
 * when out of memory). Folding these into the call saves the ops around each matmul. */
static const float *prepare(const float *x, int rows, int k, const float *norm, float eps,
                            int gated, float **buf, int threads) {
    *buf = NULL;
    if (!norm && !gated) return x;
    float *out = malloc(sizeof(float) * (size_t)rows * k);
    if (!out) return NULL;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > ROW_PATH_MAX)
    for (int i = 0; i < rows; i++) {
        float *o = out + (size_t)i * k;
        if (gated) {
            const float *a = x + (size_t)i * 2 * k, *b = a + k;
            for (int j = 0; j < k; j++) o[j] = a[j] / (1.0f + expf(-a[j])) * b[j];
        } else {
            const float *v = x + (size_t)i * k;
            double squares = 0;
            for (int j = 0; j < k; j++) squares += (double)v[j] * v[j];
            float r = 1.0f / sqrtf((float)(squares / k) + eps);
            for (int j = 0; j < k; j++) o[j] = v[j] * r * norm[j];
        }
    }
    *buf = out;
    return out;
}

/* NBQ_ROUND16's input: x (rows, k) rounded per group of `group` inputs (32, or 256 for the
 * GGUF types of 256-weight blocks), q = round(x / s) as int16 with s = max |x| / 32767 over
 * the group (its largest magnitude becomes +-32767; s = 0 for a group of zeros), so q * s is
 * x within s / 2 = max |x| / 65534. s: (rows, k / group). sums, unless NULL: (rows, k / 16),
 * each 16 inputs' s * sum(q), the rounded input's sum (for the weights' mins). One rounding
 * for every kernel that takes it (quant_matmul.c, gguf_blocks.c). */
__attribute__((unused)) static void round16(const float *x, int rows, int k, int group,
                                            int16_t *q, float *s, float *sums) {
    int ng = k / group;
    for (int i = 0; i < rows; i++)
        for (int g = 0; g < ng; g++) {
            const float *v = x + (size_t)i * k + (size_t)g * group;
            int16_t *o = q + (size_t)i * k + (size_t)g * group;
            float *su = sums ? sums + (size_t)i * (k / 16) + (size_t)g * (group / 16) : NULL;
#if defined(__AVX2__)  /* the same operations, 8 at a time (cvtps rounds to nearest even) */
            __m256 m = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.f);
            for (int j = 0; j < group; j += 8)
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            float inv = amax > 0.f ? 32767.f / amax : 0.f, scale = amax / 32767.f;
            for (int j = 0; j < group; j += 16) {
                __m256i c0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j),
                                                              _mm256_set1_ps(inv)));
                __m256i c1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j + 8),
                                                              _mm256_set1_ps(inv)));
                /* packs interleaves 128-bit lanes: put them back */
                __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8);
                _mm256_storeu_si256((__m256i *)(o + j), packed);
                if (su) {
                    __m256i t = _mm256_add_epi32(c0, c1);
                    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t),
                                               _mm256_extracti128_si256(t, 1));
                    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
                    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
                    su[j / 16] = scale * (float)_mm_cvtsi128_si32(t4);
                }
            }
#else
            float amax = 0.f;
            for (int j = 0; j < group; j++) amax = fmaxf(amax, fabsf(v[j]));
            float inv = amax > 0.f ? 32767.f / amax : 0.f, scale = amax / 32767.f;
            for (int j = 0; j < group; j++) o[j] = (int16_t)lrintf(v[j] * inv);
            if (su)
                for (int h = 0; h < group / 16; h++) {
                    int total = 0;
                    for (int j = 0; j < 16; j++) total += o[16 * h + j];
                    su[h] = scale * (float)total;
                }
#endif
            s[(size_t)i * ng + g] = scale;
        }
}

/* ---------------------------------------------------------------- steps of many rows
 * Past ROW_PATH_MAX input rows: the input is laid out k-major once (xt, k x R rounded up to
 * LANES, zeros past R); then each thread takes the weights NW rows (outputs) at a time,
 * dequantizes them into float32 exactly as GGUF's dequantization does (d * q, then + m), and
 * runs a register-blocked kernel over them: NW outputs x 2 LANES input rows of accumulators,
 * per k one weight broadcast against two vectors of LANES input rows (the shape of BLAS
 * micro-kernels).
 * The weights are read and decoded once per step whatever the row count. Every output sums
 * each chunk of KC k in order, one FMA each, then adds the chunk sums in order, in its own
 * lane, so a row's result does not depend on the other rows of the step. Written with GCC
 * vector types: one source serves the AVX-512 (16 lanes), AVX2 and plain (8) builds. */
#define NW 6  /* the cases in weight_panel follow NW */
#define PANEL 48  /* weight rows dequantized at a time (a multiple of NW) */
#define KC 128  /* k chunk: each output adds up sums of KC products (closer to float64 than
                    one chain over all k, and as fast) */
/* A vector of input lanes: 16 where the CPU has AVX-512 (twice the multiply-adds an
 * instruction), else 8. Each lane is one input row's own sum, in the same order either way,
 * so the lane width changes the speed, never a value. */
#if defined(__AVX512F__)
#define LANES 16
typedef float v8f __attribute__((vector_size(64)));
typedef float v8f_u __attribute__((vector_size(64), aligned(4)));  /* unaligned loads */
#else
#define LANES 8
typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));  /* unaligned loads */
#endif

INLINE v8f load8(const float *p) { return *(const v8f_u *)p; }
INLINE void store8(float *p, v8f v) { *(v8f_u *)p = v; }

INLINE v8f splat(float v) {  /* v in every lane */
#if defined(__AVX512F__)
    return (v8f)_mm512_set1_ps(v);
#elif defined(__AVX__)
    return (v8f)_mm256_set1_ps(v);
#else
    return (v8f){v, v, v, v, v, v, v, v};
#endif
}

INLINE v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__AVX512F__)
    return (v8f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && defined(__AVX__)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* tile[c][l] (+)= the sum over j0 <= j < j1 of w[c, j] xt[j, i0 + l] for nw weight rows w
 * (nw, k) and input lanes i0 .. i0 + V * 8 - 1 of xt (k, lanes); `add`: onto the tile. */
INLINE void micro(const float *w, int nw, int k, int j0, int j1, const float *xt, int lanes,
                  int i0, int V, float *tile, int add) {
    v8f acc[NW][2];
    for (int c = 0; c < nw; c++)
        for (int h = 0; h < V; h++) acc[c][h] = (v8f){0};
    for (int j = j0; j < j1; j++) {
        const float *xj = xt + (size_t)j * lanes + i0;
        v8f xv[2];
        for (int h = 0; h < V; h++) xv[h] = load8(xj + LANES * h);
        for (int c = 0; c < nw; c++) {
            v8f b = splat(w[(size_t)c * k + j]);
            for (int h = 0; h < V; h++) acc[c][h] = fma8(b, xv[h], acc[c][h]);
        }
    }
    for (int c = 0; c < nw; c++)
        for (int h = 0; h < V; h++) {
            float *t = tile + (c * 2 + h) * LANES;
            store8(t, add ? load8(t) + acc[c][h] : acc[c][h]);
        }
}

/* every input row times nw_all (<= PANEL) dequantized weight rows w (outputs c0 .. of y): for
 * each tile of 16 input lanes, k in chunks of KC, each group of NW weight rows in turn, so that
 * a chunk of the tile's xt columns stays in L1 for every group; each output adds up its chunk
 * sums in order (in `tiles`, one per group) */
static void weight_panel(const float *w, int nw_all, int k, const float *xt, int lanes,
                         int rows, float *y, int n) {
    float tiles[PANEL / NW][NW * 2 * LANES];
    for (int i0 = 0; i0 < lanes; i0 += 2 * LANES) {
        int V = lanes - i0 >= 2 * LANES ? 2 : 1;
        for (int j0 = 0; j0 < k; j0 += KC) {
            int j1 = k - j0 < KC ? k : j0 + KC, add = j0 > 0;
            for (int c0 = 0; c0 < nw_all; c0 += NW) {
                int nw = nw_all - c0 < NW ? nw_all - c0 : NW;
                const float *wc = w + (size_t)c0 * k;
                float *tile = tiles[c0 / NW];
#define GROUP_CASE(NWC) if (V == 2) micro(wc, NWC, k, j0, j1, xt, lanes, i0, 2, tile, add); \
                        else micro(wc, NWC, k, j0, j1, xt, lanes, i0, 1, tile, add)
                switch (nw) {  /* constant sizes: the accumulators stay in registers */
                case 1: GROUP_CASE(1); break;
                case 2: GROUP_CASE(2); break;
                case 3: GROUP_CASE(3); break;
                case 4: GROUP_CASE(4); break;
                case 5: GROUP_CASE(5); break;
                default: GROUP_CASE(NW);
                }
#undef GROUP_CASE
            }
        }
        for (int c0 = 0; c0 < nw_all; c0 += NW) {  /* the tiles into y */
            int nw = nw_all - c0 < NW ? nw_all - c0 : NW;
            const float *tile = tiles[c0 / NW];
            for (int l = 0; l < V * LANES && i0 + l < rows; l++)
                for (int c = 0; c < nw; c++)
                    y[(size_t)(i0 + l) * n + c0 + c] = tile[(c * 2 + l / LANES) * LANES + l % LANES];
        }
    }
}

#endif
