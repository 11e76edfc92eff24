/* Matrix products over quantized weight blocks, for nbserve's "quantized" weights.
 *
 * y[i, n] = sum_k x[i, k] * w[n, k] for float32 inputs x (R, K) and a weight w (N, K) stored as
 * blocks of 32 consecutive k:
 *   q4: w = d * q + m, q a 4-bit code (0..15), 16 bytes a block: byte j holds code j in its low
 *       nibble and code j + 16 in its high one (the GGUF Q4_0/Q4_1 order; Q4_0 is m = -8 d);
 *   q8: w = d * q, q a signed byte, 32 bytes a block (the GGUF Q8_0 order).
 * d and m are float16 arrays (N, K / 32), as GGUF stores them, read as float32 (exactly).
 * Everything else is float32, except with the flag NBQ_ROUND16 on the AVX2 and AVX-512 paths:
 * there inputs of one or two rows are rounded to 16 bits per block of 32 (integer row kernels,
 * faster there). Never to 8 bits as llama.cpp's CPU kernels do: that changed most of the
 * default model's greedy answers, 16 bits none (benchmarks/activation_rounding.py).
 *
 * Two ways, by the number of input rows:
 * - up to ROW_PATH_MAX rows (a lone stream, small batches), the row kernels: output rows shared
 *   among `threads` OpenMP threads, x read once per output row from L1, each weight block
 *   decoded once for up to TILE input rows. The AVX-512 path rebuilds each weight exactly as
 *   GGUF's dequantization does (d * q, then + m) and multiplies it as a float32 model would;
 *   the AVX2 and plain C paths add d * sum(x * q) + m * sum(x) per block. With NBQ_ROUND16, the
 *   AVX2 and AVX-512 paths do the same over the input's 16-bit codes, in integers (row16: the
 *   same 256-bit code on both; whether an AVX-512 machine takes it or its table path is timed
 *   once per machine, nbserve/cpu/kernels/tuning.py).
 * - more rows (batches, prefills), the panels (matmul_common.h): weight rows dequantized
 *   exactly as GGUF does, then a register-blocked float32 kernel.
 * Either way a product differs from one over the dequantized weights only in summation order,
 * and a row's result does not depend on the other rows of the call within one way.
 *
 * The threads are the same OpenMP runtime as torch's, so the same pool. Built at first use with
 * -march=native (nbserve/cpu/kernels/build.py): the AVX-512 or AVX2 path where the CPU has it,
 * plain C elsewhere.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "nbserve_kernels.h"
#include "matmul_common.h"

#define BLOCK 32
#define TILE 4
#define PREFETCH_ROWS 4  /* the row kernels ask for the weight blocks of the output row this
                          many rows ahead of the one they multiply, into all cache levels
                          (prefetcht0: the non-temporal hint was slower on both paths;
                          benchmarks/README.md) */
/* weight kinds NBQ_Q4, NBQ_Q8, NBQ_F32 and flags NBQ_GATED, NBQ_ROUND16: nbserve_kernels.h.
 * NBQ_ROUND16: inputs of up to ROUND16_MAX_ROWS rows are rounded to 16 bits per block (round16)
 * for the integer row kernels, where the build has them; other inputs, and builds without
 * them, keep float32. */
#define ROUND16_MAX_ROWS 2  /* measured faster up to here; from 4 rows on, as slow or slower
                               than the float32 row kernels, whose weight decoding is shared
                               by the rows (benchmarks/README.md) */


int nbq_simd_width(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    return 8;
#else
    return 1;
#endif
}

/* sums[i * nb + b] = sum of x[i, 32 b .. 32 b + 31] (the m terms of q4) */
static inline void block_sums(const float *x, int rows, int k, float *sums) {
    int nb = k / BLOCK;
    for (int i = 0; i < rows; i++)
        for (int b = 0; b < nb; b++) {
            const float *v = x + (size_t)i * k + (size_t)b * BLOCK;
            float s = 0.f;
            for (int j = 0; j < BLOCK; j++) s += v[j];
            sums[i * nb + b] = s;
        }
}

#if defined(__AVX2__) && defined(__FMA__)  /* also under AVX-512: the 16-bit row kernels */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 float16 values as float32 */
INLINE __m256 half8(const half_t *p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    return _mm256_setr_ps(h2f(p[0]), h2f(p[1]), h2f(p[2]), h2f(p[3]), h2f(p[4]), h2f(p[5]),
                          h2f(p[6]), h2f(p[7]));
#endif
}

/* out[i] = the lanes of acc[i] + q4's m terms: the sum over blocks of m[b] * (the block sum of
 * the input, xs), 8 blocks a vector into macc[i] (zeros on entry) */
INLINE void q4_finish(const __m256 *acc, __m256 *macc, int rows, int nb, const half_t *m,
                      const float *xs, float *out, int n_out) {
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m256 mv = half8(m + b);
        for (int i = 0; i < rows; i++)
            macc[i] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + i * nb + b), macc[i]);
    }
    for (int i = 0; i < rows; i++) {
        float tail = 0.f;
        for (int t = b; t < nb; t++) tail += h2f(m[t]) * xs[i * nb + t];
        out[(size_t)i * n_out] = hsum(acc[i]) + (hsum(macc[i]) + tail);
    }
}

#endif

#if defined(__AVX512F__)
/* Per block, the weights themselves: q4 codes index a 16-entry table d * j + m (one register,
 * vpermps), q8 codes are converted and scaled; both give the dequantized float32 weights
 * exactly (one rounding each for d * j and + m, as GGUF's dequantization). Each input row then
 * takes two FMAs per block into two accumulators: no per-block scale chain, no m term. */
#define HAS_TABLE_PATH 1
/* one block's weights (two registers of 16) times `rows` input rows, into acc[2 i], acc[2 i + 1] */
INLINE void fma_rows(__m512 w0, __m512 w1, const float *x, int rows, int k, __m512 *acc) {
    for (int i = 0; i < rows; i++) {
        const float *v = x + (size_t)i * k;
        acc[2 * i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v), acc[2 * i]);
        acc[2 * i + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v + 16), acc[2 * i + 1]);
    }
}

/* the 32 weights of block b: kind NBQ_Q4, NBQ_Q8 (m unused) or NBQ_F32 (qs: float32 weights,
 * d, m unused) */
INLINE void block_weights(int kind, const uint8_t *qs, int b, const half_t *d, const half_t *m,
                          __m512 *w0, __m512 *w1) {
    if (kind == NBQ_F32) {
        *w0 = _mm512_loadu_ps((const float *)qs + b * BLOCK);
        *w1 = _mm512_loadu_ps((const float *)qs + b * BLOCK + 16);
        return;
    }
    __m512 scale = _mm512_set1_ps(h2f(d[b]));
    if (kind == NBQ_Q4) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + b * 16)));
        __m512 table = _mm512_add_ps(_mm512_mul_ps(iota, scale), _mm512_set1_ps(h2f(m[b])));
        *w0 = _mm512_permutexvar_ps(codes, table);  /* uses the low 4 bits: the low nibble */
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
    } else {
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + b * BLOCK));
        __m512i lo = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q));
        __m512i hi = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1));
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), scale);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), scale);
    }
}

/* Output row of weight blocks `qs` against `rows` input rows. Even and odd blocks sum into
 * separate accumulators: a single chain of FMAs would wait 4 cycles a block on the last one. */
INLINE void dot_rows(int kind, const float *x, int rows, int k, const uint8_t *qs,
                     const half_t *d, const half_t *m, float *out, int n_out) {
    int nb = k / BLOCK, b = 0;
    __m512 even[2 * TILE], odd[2 * TILE], w0, w1;
    for (int i = 0; i < 2 * TILE; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (; b + 1 < nb; b += 2) {
        block_weights(kind, qs, b, d, m, &w0, &w1);
        fma_rows(w0, w1, x + (size_t)b * BLOCK, rows, k, even);
        block_weights(kind, qs, b + 1, d, m, &w0, &w1);
        fma_rows(w0, w1, x + (size_t)(b + 1) * BLOCK, rows, k, odd);
    }
    if (b < nb) {
        block_weights(kind, qs, b, d, m, &w0, &w1);
        fma_rows(w0, w1, x + (size_t)b * BLOCK, rows, k, even);
    }
    for (int i = 0; i < rows; i++) {
        __m512 sum = _mm512_add_ps(_mm512_add_ps(even[2 * i], even[2 * i + 1]),
                                   _mm512_add_ps(odd[2 * i], odd[2 * i + 1]));
        out[(size_t)i * n_out] = _mm512_reduce_add_ps(sum);
    }
}

INLINE void q4_row(const float *x, int rows, int k, const uint8_t *qs, const half_t *d,
                   const half_t *m, const float *xs, float *out, int n_out) {
    (void)xs;
    dot_rows(NBQ_Q4, x, rows, k, qs, d, m, out, n_out);
}

INLINE void q8_row(const float *x, int rows, int k, const int8_t *qs, const half_t *d,
                   float *out, int n_out) {
    dot_rows(NBQ_Q8, x, rows, k, (const uint8_t *)qs, d, d, out, n_out);
}

INLINE void f32_row(const float *x, int rows, int k, const float *w, float *out, int n_out) {
    dot_rows(NBQ_F32, x, rows, k, (const uint8_t *)w, NULL, NULL, out, n_out);
}

#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* one block: its 32 codes as floats (four registers of 8) times v, summed lane-wise */
INLINE __m256 block_dot(const __m256 *w, const float *v) {
    __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(v));
    t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(v + 8), t);
    t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(v + 16), t);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(v + 24), t);
}

INLINE void q4_row(const float *x, int rows, int k, const uint8_t *qs, const half_t *d,
                   const half_t *m, const float *xs, float *out, int n_out) {
    int nb = k / BLOCK;
    __m256 acc[TILE], macc[TILE];
    for (int i = 0; i < TILE; i++) acc[i] = macc[i] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int b = 0; b < nb; b++) {
        /* bytes 0-7 and 8-15 widened to 32 bits straight from memory: each byte's low
         * nibble is code j, its high nibble code j + 16 */
        __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + (size_t)b * 16)));
        __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + (size_t)b * 16 + 8)));
        __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_and_si256(c0, low)),
                       _mm256_cvtepi32_ps(_mm256_and_si256(c1, low)),
                       _mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)),
                       _mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4))};
        __m256 scale = _mm256_set1_ps(h2f(d[b]));
        for (int i = 0; i < rows; i++) {
            const float *v = x + (size_t)i * k + (size_t)b * BLOCK;
            acc[i] = _mm256_fmadd_ps(scale, block_dot(w, v), acc[i]);
        }
    }
    q4_finish(acc, macc, rows, nb, m, xs, out, n_out);
}

INLINE void q8_row(const float *x, int rows, int k, const int8_t *qs, const half_t *d,
                   float *out, int n_out) {
    int nb = k / BLOCK;
    __m256 acc[TILE];
    for (int i = 0; i < TILE; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int8_t *q = qs + (size_t)b * BLOCK;
        __m256 w[4];
        for (int j = 0; j < 4; j++) w[j] = i8x8(_mm_loadl_epi64((const __m128i *)(q + 8 * j)));
        __m256 scale = _mm256_set1_ps(h2f(d[b]));
        for (int i = 0; i < rows; i++) {
            const float *v = x + (size_t)i * k + (size_t)b * BLOCK;
            acc[i] = _mm256_fmadd_ps(scale, block_dot(w, v), acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) out[(size_t)i * n_out] = hsum(acc[i]);
}

INLINE void f32_row(const float *x, int rows, int k, const float *w, float *out, int n_out) {
    __m256 acc[TILE];
    for (int i = 0; i < TILE; i++) acc[i] = _mm256_setzero_ps();
    for (int j = 0; j < k; j += 8) {
        __m256 wj = _mm256_loadu_ps(w + j);
        for (int i = 0; i < rows; i++)
            acc[i] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x + (size_t)i * k + j), acc[i]);
    }
    for (int i = 0; i < rows; i++) out[(size_t)i * n_out] = hsum(acc[i]);
}

#else  /* plain C */
INLINE void q4_row(const float *x, int rows, int k, const uint8_t *qs, const half_t *d,
                   const half_t *m, const float *xs, float *out, int n_out) {
    int nb = k / BLOCK;
    for (int i = 0; i < rows; i++) {
        float acc = 0.f;
        for (int b = 0; b < nb; b++) {
            const float *v = x + (size_t)i * k + (size_t)b * BLOCK;
            const uint8_t *q = qs + (size_t)b * 16;
            float t = 0.f;
            for (int j = 0; j < 16; j++) t += (q[j] & 15) * v[j] + (q[j] >> 4) * v[j + 16];
            acc += h2f(d[b]) * t + h2f(m[b]) * xs[i * nb + b];
        }
        out[(size_t)i * n_out] = acc;
    }
}

INLINE void q8_row(const float *x, int rows, int k, const int8_t *qs, const half_t *d,
                   float *out, int n_out) {
    int nb = k / BLOCK;
    for (int i = 0; i < rows; i++) {
        float acc = 0.f;
        for (int b = 0; b < nb; b++) {
            const float *v = x + (size_t)i * k + (size_t)b * BLOCK;
            const int8_t *q = qs + (size_t)b * BLOCK;
            float t = 0.f;
            for (int j = 0; j < BLOCK; j++) t += q[j] * v[j];
            acc += h2f(d[b]) * t;
        }
        out[(size_t)i * n_out] = acc;
    }
}
INLINE void f32_row(const float *x, int rows, int k, const float *w, float *out, int n_out) {
    for (int i = 0; i < rows; i++) {
        float acc = 0.f;
        for (int j = 0; j < k; j++) acc += w[j] * x[(size_t)i * k + j];
        out[(size_t)i * n_out] = acc;
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The same with the input rounded to 16 bits per block (flag NBQ_ROUND16, see round16): x16 the
 * codes, xsc their scales (rows x blocks). A block's products are integers: vpmaddwd (weight
 * code times input code, pairs summed), exact in int32. Eight blocks' sums are gathered into
 * one vector (horizontal adds) and scaled at once by d * the input's scale (the conversion to
 * float32 rounds only sums past 2^24, by < 2^-24). Decoding a block to 16-bit codes is three
 * instructions against ten to float32, which is most of a lone row's work here. */
#define HAS_ROUND16 1
/* one block's 32 weight codes as two vectors of 16 int16, in k order */
INLINE void codes16(int kind, const uint8_t *qs, int b, __m256i *w0, __m256i *w1) {
    if (kind == NBQ_Q4) {  /* low nibbles: codes 0-15, high nibbles: codes 16-31 */
        __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + (size_t)b * 16)));
        *w0 = _mm256_and_si256(c, _mm256_set1_epi16(0x0F));
        *w1 = _mm256_srli_epi16(c, 4);
    } else {
        const int8_t *q = (const int8_t *)qs + (size_t)b * BLOCK;
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
    }
}

/* sum over the block of weight code * input code, in 8 int32 lanes */
INLINE __m256i products16(__m256i w0, __m256i w1, const int16_t *v) {
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)v)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(v + 16))));
}

/* blocks b, b + 1 of every row: hadd of their sums (lanes: b's pairs, then b + 1's, per half) */
INLINE void pair16(int kind, const uint8_t *qs, int b, const int16_t *x16, int rows, int k,
                   __m256i *h) {
    __m256i w0, w1, u0, u1;
    codes16(kind, qs, b, &w0, &w1);
    codes16(kind, qs, b + 1, &u0, &u1);
    for (int i = 0; i < rows; i++) {
        const int16_t *v = x16 + (size_t)i * k + (size_t)b * BLOCK;
        h[i] = _mm256_hadd_epi32(products16(w0, w1, v), products16(u0, u1, v + BLOCK));
    }
}

INLINE void row16(int kind, const int16_t *x16, const float *xsc, int rows, int k,
                  const uint8_t *qs, const half_t *d, const half_t *m, const float *xs,
                  float *out, int n_out) {
    int nb = k / BLOCK, b = 0;
    __m256 acc[ROUND16_MAX_ROWS], macc[ROUND16_MAX_ROWS];
    for (int i = 0; i < ROUND16_MAX_ROWS; i++) acc[i] = macc[i] = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) {  /* eight blocks' sums into one vector, then scaled */
        __m256i h0[ROUND16_MAX_ROWS], h1[ROUND16_MAX_ROWS], h2[ROUND16_MAX_ROWS],
            h3[ROUND16_MAX_ROWS];
        pair16(kind, qs, b, x16, rows, k, h0);
        pair16(kind, qs, b + 2, x16, rows, k, h1);
        pair16(kind, qs, b + 4, x16, rows, k, h2);
        pair16(kind, qs, b + 6, x16, rows, k, h3);
        __m256 d8 = half8(d + b);
        for (int i = 0; i < rows; i++) {
            /* blocks b..b+3 in each half (lanes 0-3), b+4..b+7 likewise; then the halves */
            __m256i lo = _mm256_hadd_epi32(h0[i], h1[i]), hi = _mm256_hadd_epi32(h2[i], h3[i]);
            __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                            _mm256_permute2x128_si256(lo, hi, 0x31));
            __m256 scale = _mm256_mul_ps(d8, _mm256_loadu_ps(xsc + i * nb + b));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[i]);
        }
    }
    for (; b < nb; b++) {  /* the last nb % 8 blocks, one at a time */
        __m256i w0, w1;
        codes16(kind, qs, b, &w0, &w1);
        float db = h2f(d[b]);
        for (int i = 0; i < rows; i++) {
            __m256i p = products16(w0, w1, x16 + (size_t)i * k + (size_t)b * BLOCK);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(db * xsc[i * nb + b]),
                                     acc[i]);
        }
    }
    if (kind == NBQ_Q8) {
        for (int i = 0; i < rows; i++) out[(size_t)i * n_out] = hsum(acc[i]);
        return;
    }
    q4_finish(acc, macc, rows, nb, m, xs, out, n_out);  /* m terms from the float32 input */
}

INLINE void q4_row16(const int16_t *x16, const float *xsc, int rows, int k, const uint8_t *qs,
                     const half_t *d, const half_t *m, const float *xs, float *out, int n_out) {
    row16(NBQ_Q4, x16, xsc, rows, k, qs, d, m, xs, out, n_out);
}

INLINE void q8_row16(const int16_t *x16, const float *xsc, int rows, int k, const int8_t *qs,
                     const half_t *d, float *out, int n_out) {
    row16(NBQ_Q8, x16, xsc, rows, k, (const uint8_t *)qs, d, NULL, NULL, out, n_out);
}

#endif

/* The panels' weights (the panels themselves: matmul_common.h).
 * Weight rows r0 .. r0 + nr - 1 of `kind` as float32 rows of k (buf, nr * k). */
static void dequant_rows(int kind, const uint8_t *codes, const half_t *d, const half_t *m,
                         int r0, int nr, int k, float *buf) {
    int nb = k / BLOCK;
    for (int r = 0; r < nr; r++) {
        const half_t *rd = d + (size_t)(r0 + r) * nb, *rm = m ? m + (size_t)(r0 + r) * nb : NULL;
        float *out = buf + (size_t)r * k;
        if (kind == NBQ_Q4) {
            const uint8_t *q = codes + (size_t)(r0 + r) * (k / 2);
            for (int b = 0; b < nb; b++, q += 16, out += BLOCK) {
                float scale = h2f(rd[b]), min = h2f(rm[b]);
#if defined(__AVX2__)
                __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(min);
                __m128i packed = _mm_loadu_si128((const __m128i *)q);
                __m128i lo = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
                __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
                __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                for (int h = 0; h < 4; h++) {  /* d * q, then + m: two roundings, as GGUF */
                    __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[h]));
                    _mm256_storeu_ps(out + 8 * h, _mm256_add_ps(_mm256_mul_ps(qf, vs), vm));
                }
                continue;
#endif
                for (int j = 0; j < 16; j++) {
                    out[j] = scale * (float)(q[j] & 15) + min;
                    out[j + 16] = scale * (float)(q[j] >> 4) + min;
                }
            }
        } else {
            const int8_t *q = (const int8_t *)codes + (size_t)(r0 + r) * k;
            for (int b = 0; b < nb; b++, q += BLOCK, out += BLOCK) {
                float scale = h2f(rd[b]);
#if defined(__AVX2__)
                __m256 vs = _mm256_set1_ps(scale);
                for (int h = 0; h < 4; h++) {
                    __m128i part = _mm_loadl_epi64((const __m128i *)(q + 8 * h));
                    __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part));
                    _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(qf, vs));
                }
                continue;
#endif
                for (int j = 0; j < BLOCK; j++) out[j] = scale * (float)q[j];
            }
        }
    }
}

/* the most input rows the row kernels take; more go to the panels */
int nbq_row_path_max(void) { return ROW_PATH_MAX; }

/* the most input rows that NBQ_ROUND16 rounds in this build (0: it has no integer row kernels) */
int nbq_round16_max_rows(void) {
#ifdef HAS_ROUND16
    return ROUND16_MAX_ROWS;
#else
    return 0;
#endif
}

/* y (R, N) = x (R, K) @ w.T, PANEL outputs a work item; -1 when out of memory */
static int panel_matmul(int kind, const float *x, int rows, int k, const void *codes,
                        const half_t *d, const half_t *m, int n, float *y, int threads) {
    int lanes = (rows + LANES - 1) / LANES * LANES, panels = (n + PANEL - 1) / PANEL, failed = 0;
    float *xt = malloc(sizeof(float) * (size_t)k * lanes);
    if (!xt) return -1;
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        #pragma omp for schedule(static)
        for (int j = 0; j < k; j++)
            for (int i = 0; i < lanes; i++)
                xt[(size_t)j * lanes + i] = i < rows ? x[(size_t)i * k + j] : 0.f;
        float *buf = kind == NBQ_F32 ? NULL : malloc(sizeof(float) * (size_t)PANEL * k);
        if (kind != NBQ_F32 && !buf) failed = 1;
        #pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            if (failed) continue;
            int c0 = p * PANEL, nw = n - c0 < PANEL ? n - c0 : PANEL;
            const float *w = kind == NBQ_F32 ? (const float *)codes + (size_t)c0 * k : buf;
            if (kind != NBQ_F32) dequant_rows(kind, (const uint8_t *)codes, d, m, c0, nw, k, buf);
            weight_panel(w, nw, k, xt, lanes, rows, y + c0, n);
        }
        free(buf);
    }
    free(xt);
    return failed ? -1 : 0;
}

/* y (R, N) = prepare(x) (R, K) @ w.T for a weight of `kind`: NBQ_Q4 codes (N, K/2) bytes with
 * d and m (N, K/32); NBQ_Q8 codes (N, K) signed bytes with d (N, K/32); NBQ_F32 (N, K) floats.
 * Up to ROW_PATH_MAX rows, the row kernels above (on the input rounded to 16 bits with
 * NBQ_ROUND16 in `flags`, where the build has those kernels); more, the panels.
 * Returns 0, or -1 when out of memory (y is then not written). */
static int matmul(int kind, const float *x, int rows, int k, const void *codes, const half_t *d,
                  const half_t *m, int n, float *y, int threads, const float *norm, float eps,
                  int flags) {
    int nb = k / BLOCK;
    size_t row_bytes = kind == NBQ_Q4 ? (size_t)k / 2 : kind == NBQ_Q8 ? (size_t)k : (size_t)k * 4;
    float *buf, *xs = NULL, *xsc = NULL;
    int16_t *x16 = NULL;
    x = prepare(x, rows, k, norm, eps, flags & NBQ_GATED, &buf, threads);
    if (!x) return -1;
    if (rows > ROW_PATH_MAX) {
        int failed = panel_matmul(kind, x, rows, k, codes, d, m, n, y, threads);
        free(buf);
        return failed;
    }
#ifdef HAS_ROUND16
    if ((flags & NBQ_ROUND16) && kind != NBQ_F32 && rows <= ROUND16_MAX_ROWS) {
        x16 = malloc(sizeof(int16_t) * (size_t)rows * k);
        xsc = malloc(sizeof(float) * (size_t)rows * nb);
        if (!x16 || !xsc) { free(x16); free(xsc); free(buf); return -1; }
        round16(x, rows, k, 32, x16, xsc, NULL);
    }
#endif
#ifdef HAS_TABLE_PATH  /* the table path needs no block sums, the 16-bit kernels do */
    if (kind == NBQ_Q4 && x16) {
#else
    if (kind == NBQ_Q4) {
#endif
        xs = malloc(sizeof(float) * (size_t)rows * nb);
        if (!xs) { free(x16); free(xsc); free(buf); return -1; }
        block_sums(x, rows, k, xs);
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < n; r++) {
        const uint8_t *wq = (const uint8_t *)codes + (size_t)r * row_bytes;
        const half_t *wd = d ? d + (size_t)r * nb : NULL, *wm = m ? m + (size_t)r * nb : NULL;
        if (kind != NBQ_F32 && r + PREFETCH_ROWS < n) {  /* this thread's row PREFETCH_ROWS on */
            const char *ahead = (const char *)wq + PREFETCH_ROWS * row_bytes;
            for (size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(ahead + o, 0, 3);
            __builtin_prefetch(wd + PREFETCH_ROWS * nb, 0, 3);
            if (wm) __builtin_prefetch(wm + PREFETCH_ROWS * nb, 0, 3);
        }
        for (int i0 = 0; i0 < rows; i0 += TILE) {
            const float *xi = x + (size_t)i0 * k, *si = xs ? xs + (size_t)i0 * nb : NULL;
            float *yi = y + (size_t)i0 * n + r;
            int t = rows - i0 < TILE ? rows - i0 : TILE;
#ifdef HAS_ROUND16
            if (x16) {
                const int16_t *qi = x16 + (size_t)i0 * k;
                const float *ci = xsc + (size_t)i0 * nb;
#define ROWS16(T) if (kind == NBQ_Q4) q4_row16(qi, ci, T, k, wq, wd, wm, si, yi, n); \
                  else q8_row16(qi, ci, T, k, (const int8_t *)wq, wd, yi, n)
                if (t == 1) ROWS16(1);  /* t <= ROUND16_MAX_ROWS */
                else ROWS16(ROUND16_MAX_ROWS);
#undef ROWS16
                continue;
            }
#endif
            /* constant row counts, so that the accumulators stay in registers */
#define ROWS(T) if (kind == NBQ_Q4) q4_row(xi, T, k, wq, wd, wm, si, yi, n); \
                else if (kind == NBQ_Q8) q8_row(xi, T, k, (const int8_t *)wq, wd, yi, n); \
                else f32_row(xi, T, k, (const float *)wq, yi, n)
            switch (t) {
            case 1: ROWS(1); break;
            case 2: ROWS(2); break;
            case 3: ROWS(3); break;
            default: ROWS(TILE);
            }
#undef ROWS
        }
    }
    free(x16);
    free(xsc);
    free(xs);
    free(buf);
    return 0;
}

int nbq_q4_matmul(const float *x, int rows, int k, const uint8_t *codes, const half_t *d,
                  const half_t *m, int n, float *y, int threads, const float *norm, float eps,
                  int flags) {
    return matmul(NBQ_Q4, x, rows, k, codes, d, m, n, y, threads, norm, eps, flags);
}

int nbq_q8_matmul(const float *x, int rows, int k, const int8_t *codes, const half_t *d, int n,
                  float *y, int threads, const float *norm, float eps, int flags) {
    return matmul(NBQ_Q8, x, rows, k, codes, d, NULL, n, y, threads, norm, eps, flags);
}

int nbq_f32_matmul(const float *x, int rows, int k, const float *w, int n, float *y,
                   int threads, const float *norm, float eps, int flags) {
    return matmul(NBQ_F32, x, rows, k, w, NULL, NULL, n, y, threads, norm, eps, flags);
}
