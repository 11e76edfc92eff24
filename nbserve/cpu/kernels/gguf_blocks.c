/* Matrix products over GGUF's own weight blocks, as the file stores them (ggml's block
 * layouts, llama.cpp ggml/src/ggml-common.h): each weight row of k inputs is k / QK blocks of
 * QK weights, one after the other, so a tensor's bytes can be used where the file maps them.
 *
 * One row per type in TYPES below, as ggml's type traits: the block's weights and bytes, its
 * dequantization to float32 and its dot with the input rows. The matmul never asks which type it
 * has; a new type is a block decoder (`<type>_block` in gguf_blocks_decode.h, exactly gguf's
 * `dequantize` arithmetic: the same float32 operations in the same order, e.g. Q4_K's
 * (d * sc) * q - dmin * m) and one DEFINE_TYPE line.
 *
 * Exact mode (the default): a row kernel decodes a block of weights into float32, in L1,
 * exactly as gguf.quants.dequantize does, and multiplies it with up to TILE input rows (on AVX2
 * and AVX-512, every type's "direct dot" builds the same weights in registers instead); more
 * than ROW_PATH_MAX input rows take the panels (matmul_common.h) over weight rows dequantized
 * the same way. A product differs from "dequantize, then a float32 matmul" only in the order of
 * its sums. The same source is the AVX-512 (16 lanes), AVX2 (8) and plain C build: the block
 * decoders are plain loops the compiler vectorizes for the build's ISA (with a shuffle or two
 * where the build has SSSE3), the products GCC vector types (matmul_common.h) or intrinsics.
 *
 * Rounded mode (flag NBQ_ROUND16, AVX2 and AVX-512 builds, up to ROW_PATH_MAX input rows;
 * on AVX-512 the 256-weight types' at any row count): the
 * input is rounded once per call to 16 bits per block of the weight type (32 inputs, or 256
 * for the K-quants and IQ4_XS, as llama.cpp's Q8_0 and Q8_K; round16, as quant_matmul.c's),
 * and every type's row kernel multiplies its codes with the input's in integers ("rounded
 * inputs" below); more rows (prompt chunks, batches) of a 256-weight type take the same
 * arithmetic over weight blocks built once for all of them (gemm16), a row's product the same
 * bits as alone. The product is then the one of gguf's weights with the rounded input, up to
 * float32 rounding: each input within max |x| / 65534 of its block's largest. With NBQ_ROUND8
 * (the caller's choice: execution/quant.py sets it for decode rows by default), Q4_K's and
 * Q6_K's take the input rounded to 8 bits per 256 as llama.cpp's CPU kernels round it (Q8_K;
 * gguf_blocks_round8.h), within max |x| / 254 (benchmarks/activation_rounding.py measures what
 * either does to greedy answers), at any row count: the 8-bit row kernels multiply in integers
 * faster than the float32 panels, so a batch takes them too, ROW_CHUNK input rows at a time,
 * and a row's product is the same bits in any batch; on the AVX-512 VNNI and AVX2 builds, a
 * batch of more than ROW_PATH_MAX rows takes gemm8 instead (gguf_blocks_gemm8.h: the same
 * integers summed in another float order, a row's product the same bits in any such batch).
 * NBQ_ROUND8_MANY alone asks for gemm8's share only, over the input rounded per 32 (prompt
 * chunks, by default: far fewer greedy answers move than with 8 bits per 256). With
 * NBQ_ROUND16 the 32-weight types' take gemm32 where the panels took them
 * (gguf_blocks_gemm32.h).
 */
#include "matmul_common.h"
#include "nbserve_kernels.h"
#if defined(__SSSE3__)
#include <tmmintrin.h>
#endif

#define TILE 4       /* input rows a row kernel multiplies per decoded block */
#define MAX_QK 256   /* the largest block (the K-quants', IQ4_XS's) */
#define N_TYPES 24   /* ggml type numbers below this */
#define ROW_CHUNK 64     /* past ROW_PATH_MAX rows, 8-bit rows a weight row meets in turn (a
                            chunk of 4,096 inputs a row: 256 KiB, in L2) */

typedef void (*to_float_fn)(const uint8_t *blocks, int nblocks, float *out);
typedef void (*dot_fn)(const float *x, int rows, int k, const uint8_t *w, float *out,
                       int n_out);
typedef void (*dot16_fn)(const int16_t *xq, const float *xs, const float *xsum, int rows, int k,
                         const uint8_t *w, float *out, int n_out);
typedef void (*dot8_fn)(const int8_t *xq, const float *xs, const int16_t *bsum, int rows, int k,
                        const uint8_t *w, float *out, int n_out);

struct built16;  /* gguf_blocks_round16.h's weight blocks built for many input rows */

/* One GGUF block type: `elems` weights in `bytes` bytes a block; to_float: `nblocks`
 * consecutive blocks as float32; dot: out[i * n_out] = x[i] . (the weight row w) for 1 to
 * TILE input rows of k. */
typedef struct {
    int elems, bytes;
    to_float_fn to_float;
    dot_fn dot;
    dot16_fn dot16;  /* the same over the input rounded to 16 bits (NBQ_ROUND16); NULL: none */
    dot8_fn dot8;    /* the same over the input rounded to 8 bits (NBQ_ROUND8); NULL: none */
    void (*build16)(const uint8_t *blk, struct built16 *o);  /* with NBQ_ROUND16, a
                        256-weight type's block built for gemm16, the products of more than
                        ROW_PATH_MAX rows (the same bits as dot16's); NULL: the panels */
    int adds16;      /* whether build16's blocks have adds (Q2_K's, Q4_K's, Q5_K's mins) */
    void (*build8)(const uint8_t *w, size_t row_bytes, int nw, void *o);  /* with
                        NBQ_ROUND8, 16 weight rows' block built for gemm8, the 8-bit products
                        of more than ROW_PATH_MAX rows; NULL: the row kernels take them */
    int sums8;       /* the input's sums gemm8 takes: per 32 (Q4_K's mins) or 16 (Q6_K) */
    void (*build32)(const uint8_t *w, size_t row_bytes, int nw, void *o);  /*
                        with NBQ_ROUND16, a 32-weight type's block of a few weight rows built for
                        gemm32, the products of more than ROW_PATH_MAX rows; NULL: the panels */
    int mins32;      /* whether a block has an m (Q4_1, Q5_1) */
} block_type;

#include "gguf_blocks_decode.h"  /* the block decoders */

/* ---------------------------------------------------------------- the row kernels */

/* acc[i][0..1] += w (QK decoded weights) times input row i (x + i * k, from the block's first
 * input), two accumulators a row so that the FMA chains interleave */
INLINE void fma_block(const float *w, int qk, const float *x, int rows, int k,
                      v8f acc[TILE][2]) {
    for (int j = 0; j < qk; j += 2 * LANES) {
        v8f w0 = load8(w + j), w1 = load8(w + j + LANES);
        for (int i = 0; i < rows; i++) {
            const float *v = x + (size_t)i * k + j;
            acc[i][0] = fma8(w0, load8(v), acc[i][0]);
            acc[i][1] = fma8(w1, load8(v + LANES), acc[i][1]);
        }
    }
}

INLINE float lanes_sum(v8f v) {
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
}

/* A type's functions: T_to_float over blocks; T_dot_n for a constant row count, through
 * decoded float32 blocks (DOT_THROUGH_FLOATS) or written for the type (direct dots below); and
 * T_dot choosing the row count (so that the accumulators stay in registers). QK is a multiple
 * of 2 LANES. */
#define TO_FLOAT(T, QK, BYTES)                                                                  \
    static void T##_to_float(const uint8_t *blocks, int nblocks, float *out) {                 \
        for (int b = 0; b < nblocks; b++) T##_block(blocks + (size_t)b * (BYTES), out + b * (QK)); \
    }
#define DOT_THROUGH_FLOATS(T, QK, BYTES)                                                        \
    INLINE void T##_dot_n(const float *x, int rows, int k, const uint8_t *w, float *out,      \
                          int n_out) {                                                          \
        float tmp[QK] __attribute__((aligned(64)));                                             \
        v8f acc[TILE][2];                                                                       \
        for (int i = 0; i < TILE; i++) acc[i][0] = acc[i][1] = (v8f){0};                        \
        for (int b = 0; b < k / (QK); b++) {                                                    \
            T##_block(w + (size_t)b * (BYTES), tmp);                                            \
            fma_block(tmp, QK, x + (size_t)b * (QK), rows, k, acc);                             \
        }                                                                                       \
        for (int i = 0; i < rows; i++) out[(size_t)i * n_out] = lanes_sum(acc[i][0] + acc[i][1]); \
    }
#define DOT_BY_ROWS(T)                                                                          \
    static void T##_dot(const float *x, int rows, int k, const uint8_t *w, float *out,        \
                        int n_out) {                                                            \
        switch (rows) {                                                                         \
        case 1: T##_dot_n(x, 1, k, w, out, n_out); break;                                       \
        case 2: T##_dot_n(x, 2, k, w, out, n_out); break;                                       \
        case 3: T##_dot_n(x, 3, k, w, out, n_out); break;                                       \
        default: T##_dot_n(x, TILE, k, w, out, n_out);                                          \
        }                                                                                       \
    }
#define DEFINE_TYPE(T, QK, BYTES) \
    TO_FLOAT(T, QK, BYTES) DOT_THROUGH_FLOATS(T, QK, BYTES) DOT_BY_ROWS(T)

#if defined(__AVX2__) && defined(__FMA__)
/* Direct dots for the K-quants most files hold: each weight built in registers from its codes
 * with gguf's float32 operations ((d sc) q, then - (dmin m)) and multiplied at once, without
 * the round trip through a decoded block in memory. VL lanes: 16 (AVX-512) or 8 (AVX2). */
#define HAS_DIRECT_DOTS 1
#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
typedef __m512i vi;
INLINE vi bytes_at(const uint8_t *p) {  /* VL bytes, each in a lane */
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
INLINE vi vshr(vi v, int n) { return _mm512_srlv_epi32(v, _mm512_set1_epi32(n)); }
INLINE vi vand(vi v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
INLINE vi vor(vi a, vi b) { return _mm512_or_si512(a, b); }
INLINE vi vshl(vi v, int n) { return _mm512_sllv_epi32(v, _mm512_set1_epi32(n)); }
INLINE vi vsubi(vi v, int n) { return _mm512_sub_epi32(v, _mm512_set1_epi32(n)); }
INLINE vi vaddi(vi a, vi b) { return _mm512_add_epi32(a, b); }
INLINE vf vfloat(vi v) { return _mm512_cvtepi32_ps(v); }
INLINE vf vset(float f) { return _mm512_set1_ps(f); }
INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vf vload(const float *p) { return _mm512_loadu_ps(p); }
INLINE vf vzero(void) { return _mm512_setzero_ps(); }
INLINE float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#else
#define VL 8
typedef __m256 vf;
typedef __m256i vi;
INLINE vi bytes_at(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
INLINE vi vshr(vi v, int n) { return _mm256_srlv_epi32(v, _mm256_set1_epi32(n)); }
INLINE vi vand(vi v, int m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
INLINE vi vor(vi a, vi b) { return _mm256_or_si256(a, b); }
INLINE vi vshl(vi v, int n) { return _mm256_sllv_epi32(v, _mm256_set1_epi32(n)); }
INLINE vi vsubi(vi v, int n) { return _mm256_sub_epi32(v, _mm256_set1_epi32(n)); }
INLINE vi vaddi(vi a, vi b) { return _mm256_add_epi32(a, b); }
INLINE vf vfloat(vi v) { return _mm256_cvtepi32_ps(v); }
INLINE vf vset(float f) { return _mm256_set1_ps(f); }
INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vload(const float *p) { return _mm256_loadu_ps(p); }
INLINE vf vzero(void) { return _mm256_setzero_ps(); }
INLINE float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* acc[i][h] += w times input row i at x + i k (VL inputs) */
INLINE void fma_rows(vf w, const float *x, int rows, int k, vf acc[TILE][2], int h) {
    for (int i = 0; i < rows; i++) acc[i][h] = vfma(w, vload(x + (size_t)i * k), acc[i][h]);
}

INLINE void finish_rows(vf acc[TILE][2], int rows, float *out, int n_out) {
    for (int i = 0; i < rows; i++) out[(size_t)i * n_out] = vsum(acc[i][0]) + vsum(acc[i][1]);
}

/* Q4_K and Q5_K: sub-blocks 2c (low nibbles of bytes c 32 ..) and 2c + 1 (high nibbles), with
 * the fifth bits 2c and 2c + 1 of qh (Q5_K; qh NULL for Q4_K) */
INLINE void k45_dot_n(const float *x, int rows, int k, const uint8_t *w, float *out, int n_out,
                      int five) {
    vf acc[TILE][2];
    for (int i = 0; i < TILE; i++) acc[i][0] = acc[i][1] = vzero();
    int bytes = five ? 176 : 144;
    for (int b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + (size_t)b * bytes, *qh = blk + 16, *qs = blk + (five ? 48 : 16);
        const float *xb = x + (size_t)b * 256;
        float d = half_at(blk), dmin = half_at(blk + 2);
        int sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        for (int c = 0; c < 4; c++) {
            vf ds0 = vset(d * (float)sc[2 * c]), dm0 = vset(dmin * (float)mn[2 * c]);
            vf ds1 = vset(d * (float)sc[2 * c + 1]), dm1 = vset(dmin * (float)mn[2 * c + 1]);
            for (int j = 0; j < 32; j += VL) {
                vi q = bytes_at(qs + c * 32 + j), lo = vand(q, 15), hi = vshr(q, 4);
                if (five) {
                    vi h = bytes_at(qh + j);
                    lo = vor(lo, vshl(vand(vshr(h, 2 * c), 1), 4));
                    hi = vor(hi, vshl(vand(vshr(h, 2 * c + 1), 1), 4));
                }
                fma_rows(vsub(vmul(ds0, vfloat(lo)), dm0), xb + c * 64 + j, rows, k, acc, 0);
                fma_rows(vsub(vmul(ds1, vfloat(hi)), dm1), xb + c * 64 + 32 + j, rows, k, acc, 1);
            }
        }
    }
    finish_rows(acc, rows, out, n_out);
}
/* Q6_K: 16 weights of one scale at a time (see q6_k_block), VL a vector */
INLINE void q6_k_dot_n(const float *x, int rows, int k, const uint8_t *w, float *out,
                       int n_out) {
    vf acc[TILE][2];
    for (int i = 0; i < TILE; i++) acc[i][0] = acc[i][1] = vzero();
    for (int b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + (size_t)b * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float *xb = x + (size_t)b * 256;
        float d = half_at(blk + 208);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int g = 0; g < 2; g++) {
                    int sb = h * 8 + s * 2 + g;
                    vf ds = vset(d * (float)sc[sb]);
                    const uint8_t *ql = blk + h * 64 + (s & 1) * 32 + g * 16;
                    const uint8_t *qh = blk + 128 + h * 32 + g * 16;
                    for (int l = 0; l < 16; l += VL) {
                        vi q = vor(vand(vshr(bytes_at(ql + l), 4 * (s >> 1)), 15),
                                   vshl(vand(vshr(bytes_at(qh + l), 2 * s), 3), 4));
                        fma_rows(vmul(ds, vfloat(vsubi(q, 32))), xb + sb * 16 + l, rows, k, acc,
                                 (sb + l / VL) & 1);
                    }
                }
    }
    finish_rows(acc, rows, out, n_out);
}

INLINE void q4_k_dot_n(const float *x, int rows, int k, const uint8_t *w, float *out,
                       int n_out) {
    k45_dot_n(x, rows, k, w, out, n_out, 0);
}

INLINE void q5_k_dot_n(const float *x, int rows, int k, const uint8_t *w, float *out,
                       int n_out) {
    k45_dot_n(x, rows, k, w, out, n_out, 1);
}

/* The 32-weight types: a block's codes as two vectors of 16 bytes (weights 0-15 and 16-31),
 * signed (sgn) or not, each weight d (q - bias), + m where has_m: gguf's float32 operations
 * (Q8_0's q d is the same product) */
INLINE void fma_codes16(__m128i c, int sgn, int bias, vf d, vf m, int has_m, const float *x,
                        int rows, int k, vf acc[TILE][2], int h) {
    for (int part = 0; part < 16 / VL; part++) {
#if VL == 16
        vi q = sgn ? _mm512_cvtepi8_epi32(c) : _mm512_cvtepu8_epi32(c);
#else
        __m128i p = part ? _mm_srli_si128(c, 8) : c;
        vi q = sgn ? _mm256_cvtepi8_epi32(p) : _mm256_cvtepu8_epi32(p);
#endif
        vf wv = vmul(d, vfloat(vsubi(q, bias)));
        fma_rows(has_m ? vadd(wv, m) : wv, x + part * VL, rows, k, acc, h);
    }
}

INLINE void nibbles16(const uint8_t *qs, __m128i *c) {  /* Q4_0's order: low, then high */
    __m128i n = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    c[0] = _mm_and_si128(n, low4);
    c[1] = _mm_and_si128(_mm_srli_epi16(n, 4), low4);
}

INLINE void q4_0_codes(const uint8_t *b, __m128i *c) { nibbles16(b + 2, c); }
INLINE void q4_1_codes(const uint8_t *b, __m128i *c) { nibbles16(b + 4, c); }
INLINE void q5_0_codes(const uint8_t *b, __m128i *c) { q5_codes16(b + 6, u32_at(b + 2), c); }
INLINE void q5_1_codes(const uint8_t *b, __m128i *c) { q5_codes16(b + 8, u32_at(b + 4), c); }
INLINE void q8_0_codes(const uint8_t *b, __m128i *c) {
    c[0] = _mm_loadu_si128((const __m128i *)(b + 2));
    c[1] = _mm_loadu_si128((const __m128i *)(b + 18));
}
INLINE void iq4_codes16(const uint8_t *qs, __m128i *c) {  /* the table's values, signed */
    __m128i table = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
    nibbles16(qs, c);
    c[0] = _mm_shuffle_epi8(table, c[0]);
    c[1] = _mm_shuffle_epi8(table, c[1]);
}
INLINE void iq4_nl_codes(const uint8_t *b, __m128i *c) { iq4_codes16(b + 2, c); }

/* T_dot_n of a 32-weight type: d at the block's start, m at M_AT (0: none) */
#define DIRECT32(T, BYTES, SGN, BIAS, M_AT)                                                      \
    INLINE void T##_dot_n(const float *x, int rows, int k, const uint8_t *w, float *out,       \
                          int n_out) {                                                           \
        vf acc[TILE][2];                                                                         \
        for (int i = 0; i < TILE; i++) acc[i][0] = acc[i][1] = vzero();                         \
        for (int b = 0; b < k / 32; b++) {                                                       \
            const uint8_t *blk = w + (size_t)b * (BYTES);                                        \
            const float *xb = x + (size_t)b * 32;                                                \
            __m128i c[2];                                                                        \
            T##_codes(blk, c);                                                                   \
            vf d = vset(half_at(blk)), m = vset((M_AT) ? half_at(blk + (M_AT)) : 0.f);           \
            fma_codes16(c[0], SGN, BIAS, d, m, (M_AT) != 0, xb, rows, k, acc, 0);                \
            fma_codes16(c[1], SGN, BIAS, d, m, (M_AT) != 0, xb + 16, rows, k, acc, 1);           \
        }                                                                                        \
        finish_rows(acc, rows, out, n_out);                                                      \
    }
DIRECT32(q4_0, 18, 0, 8, 0)
DIRECT32(q4_1, 20, 0, 0, 2)
DIRECT32(q5_0, 22, 0, 16, 0)
DIRECT32(q5_1, 24, 0, 0, 2)
DIRECT32(q8_0, 34, 1, 0, 0)
DIRECT32(iq4_nl, 18, 1, 0, 0)

/* IQ4_XS: IQ4_NL's codes, a scale per 32 weights (see iq4_xs_block) */
INLINE void iq4_xs_dot_n(const float *x, int rows, int k, const uint8_t *w, float *out,
                         int n_out) {
    vf acc[TILE][2];
    for (int i = 0; i < TILE; i++) acc[i][0] = acc[i][1] = vzero();
    for (int b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + (size_t)b * 136;
        const float *xb = x + (size_t)b * 256;
        float d = half_at(blk);
        int sh = blk[2] | (blk[3] << 8);
        for (int ib = 0; ib < 8; ib++) {
            int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
            vf dl = vset(d * (float)(ls - 32));
            __m128i c[2];
            iq4_codes16(blk + 8 + ib * 16, c);
            fma_codes16(c[0], 1, 0, dl, dl, 0, xb + ib * 32, rows, k, acc, 0);
            fma_codes16(c[1], 1, 0, dl, dl, 0, xb + ib * 32 + 16, rows, k, acc, 1);
        }
    }
    finish_rows(acc, rows, out, n_out);
}

/* Q2_K and Q3_K: 16 weights of one scale at a time (see q2_k_block, q3_k_block) */
INLINE void q2_k_dot_n(const float *x, int rows, int k, const uint8_t *w, float *out,
                       int n_out) {
    vf acc[TILE][2];
    for (int i = 0; i < TILE; i++) acc[i][0] = acc[i][1] = vzero();
    for (int b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + (size_t)b * 84;
        const float *xb = x + (size_t)b * 256;
        float d = half_at(blk + 80), dmin = half_at(blk + 82);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int g = 0; g < 2; g++) {
                    int sb = h * 8 + s * 2 + g;
                    vf dl = vset(d * (float)(blk[sb] & 15));
                    vf ml = vset(dmin * (float)(blk[sb] >> 4));
                    const uint8_t *p = blk + 16 + h * 32 + g * 16;
                    for (int l = 0; l < 16; l += VL) {
                        vi q = vand(vshr(bytes_at(p + l), 2 * s), 3);
                        fma_rows(vsub(vmul(dl, vfloat(q)), ml), xb + sb * 16 + l, rows, k, acc,
                                 (sb + l / VL) & 1);
                    }
                }
    }
    finish_rows(acc, rows, out, n_out);
}

INLINE void q3_k_dot_n(const float *x, int rows, int k, const uint8_t *w, float *out,
                       int n_out) {
    vf acc[TILE][2];
    for (int i = 0; i < TILE; i++) acc[i][0] = acc[i][1] = vzero();
    for (int b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + (size_t)b * 110, *sc = blk + 96;
        const float *xb = x + (size_t)b * 256;
        float d = half_at(blk + 108);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int g = 0; g < 2; g++) {
                    int sb = h * 8 + s * 2 + g, bit = h * 4 + s;
                    int lo = sb < 8 ? sc[sb] & 15 : sc[sb - 8] >> 4;
                    int hi = (sc[8 + sb % 4] >> (2 * (sb / 4))) & 3;
                    vf dl = vset(d * (float)((int8_t)(lo | (hi << 4)) - 32));
                    const uint8_t *p = blk + 32 + h * 32 + g * 16, *m = blk + g * 16;
                    for (int l = 0; l < 16; l += VL) {
                        vi q = vaddi(vand(vshr(bytes_at(p + l), 2 * s), 3),
                                     vshl(vand(vshr(bytes_at(m + l), bit), 1), 2));
                        fma_rows(vmul(dl, vfloat(vsubi(q, 4))), xb + sb * 16 + l, rows, k, acc,
                                 (sb + l / VL) & 1);
                    }
                }
    }
    finish_rows(acc, rows, out, n_out);
}
#endif

#include "gguf_blocks_round16.h"  /* the rounded-input row kernels, DOT16 */
#include "gguf_blocks_round8.h"   /* the 8-bit input row kernels of Q4_K and Q6_K, DOT8 */
#include "gguf_blocks_gemm8.h"    /* their products of many rows (AVX-512 VNNI, AVX2), BUILD8 */
#include "gguf_blocks_gemm32.h"   /* the 32-weight types' 16-bit products of many rows, BUILD32 */

#ifdef HAS_DIRECT_DOTS
TO_FLOAT(q2_k, 256, 84) DOT_BY_ROWS(q2_k)
TO_FLOAT(q3_k, 256, 110) DOT_BY_ROWS(q3_k)
TO_FLOAT(iq4_xs, 256, 136) DOT_BY_ROWS(iq4_xs)
TO_FLOAT(q4_0, 32, 18) DOT_BY_ROWS(q4_0)
TO_FLOAT(q4_1, 32, 20) DOT_BY_ROWS(q4_1)
TO_FLOAT(q5_0, 32, 22) DOT_BY_ROWS(q5_0)
TO_FLOAT(q5_1, 32, 24) DOT_BY_ROWS(q5_1)
TO_FLOAT(q8_0, 32, 34) DOT_BY_ROWS(q8_0)
TO_FLOAT(iq4_nl, 32, 18) DOT_BY_ROWS(iq4_nl)
TO_FLOAT(q4_k, 256, 144) DOT_BY_ROWS(q4_k)
TO_FLOAT(q5_k, 256, 176) DOT_BY_ROWS(q5_k)
TO_FLOAT(q6_k, 256, 210) DOT_BY_ROWS(q6_k)
#else
DEFINE_TYPE(q2_k, 256, 84)
DEFINE_TYPE(q3_k, 256, 110)
DEFINE_TYPE(iq4_xs, 256, 136)
DEFINE_TYPE(q4_0, 32, 18)
DEFINE_TYPE(q4_1, 32, 20)
DEFINE_TYPE(q5_0, 32, 22)
DEFINE_TYPE(q5_1, 32, 24)
DEFINE_TYPE(q8_0, 32, 34)
DEFINE_TYPE(iq4_nl, 32, 18)
DEFINE_TYPE(q4_k, 256, 144)
DEFINE_TYPE(q5_k, 256, 176)
DEFINE_TYPE(q6_k, 256, 210)
#endif

/* The served types by ggml number (enum nbq_ggml_type); elems 0: not served. K256: a
 * 256-weight type's many-row products through built blocks (gemm16), with adds or not; K8 and
 * K32: its gemm8 (with the input's sums it takes) or gemm32 (with an m or not) builder. */
#define K256(T, ADDS) .build16 = BUILD16(T), .adds16 = (ADDS)
#define K8(T, SUMS) .build8 = BUILD8(T), .sums8 = (SUMS)
#define K32(T, MINS) .build32 = BUILD32(T), .mins32 = (MINS)
static const block_type TYPES[N_TYPES] = {
    [NBQ_GGML_Q4_0] = {32, 18, q4_0_to_float, q4_0_dot, DOT16(q4_0), K32(q4_0, 0)},
    [NBQ_GGML_Q4_1] = {32, 20, q4_1_to_float, q4_1_dot, DOT16(q4_1), K32(q4_1, 1)},
    [NBQ_GGML_Q5_0] = {32, 22, q5_0_to_float, q5_0_dot, DOT16(q5_0), K32(q5_0, 0)},
    [NBQ_GGML_Q5_1] = {32, 24, q5_1_to_float, q5_1_dot, DOT16(q5_1), K32(q5_1, 1)},
    [NBQ_GGML_Q8_0] = {32, 34, q8_0_to_float, q8_0_dot, DOT16(q8_0), K32(q8_0, 0)},
    [NBQ_GGML_Q2_K] = {256, 84, q2_k_to_float, q2_k_dot, DOT16(q2_k), K256(q2_k, 1)},
    [NBQ_GGML_Q3_K] = {256, 110, q3_k_to_float, q3_k_dot, DOT16(q3_k), K256(q3_k, 0)},
    [NBQ_GGML_Q4_K] = {256, 144, q4_k_to_float, q4_k_dot, DOT16(q4_k), DOT8(q4_k), K256(q4_k, 1),
                       K8(q4_k, 32)},
    [NBQ_GGML_Q5_K] = {256, 176, q5_k_to_float, q5_k_dot, DOT16(q5_k), K256(q5_k, 1)},
    [NBQ_GGML_Q6_K] = {256, 210, q6_k_to_float, q6_k_dot, DOT16(q6_k), DOT8(q6_k), K256(q6_k, 0),
                       K8(q6_k, 16)},
    [NBQ_GGML_IQ4_NL] = {32, 18, iq4_nl_to_float, iq4_nl_dot, DOT16(iq4_nl), K32(iq4_nl, 0)},
    [NBQ_GGML_IQ4_XS] = {256, 136, iq4_xs_to_float, iq4_xs_dot, DOT16(iq4_xs), K256(iq4_xs, 0)},
};

static const block_type *type_of(int type) {
    return type >= 0 && type < N_TYPES && TYPES[type].elems ? &TYPES[type] : NULL;
}

int nbq_blocks_supported(int type) { return type_of(type) != NULL; }

int nbq_block_elems(int type) { return type_of(type) ? type_of(type)->elems : 0; }

int nbq_block_bytes(int type) { return type_of(type) ? type_of(type)->bytes : 0; }

int nbq_blocks_rounded(int type) { return type_of(type) && type_of(type)->dot16 ? 1 : 0; }

int nbq_blocks_rounded8(int type) { return type_of(type) && type_of(type)->dot8 ? 1 : 0; }

int nbq_blocks_rounded_many(int type) {
    return type_of(type) && (type_of(type)->build16 || type_of(type)->build32) ? 1 : 0;
}

int nbq_blocks_rounded8_many(int type) { return type_of(type) && type_of(type)->build8 ? 1 : 0; }

/* ---------------------------------------------------------------- many rows: the panels */

/* y (R, N) = x (R, K) @ w.T over weight rows dequantized PANEL at a time; -1: out of memory */
static int blocks_panels(const block_type *t, const float *x, int rows, int k,
                         const uint8_t *blocks, int n, float *y, int threads) {
    int lanes = (rows + LANES - 1) / LANES * LANES, panels = (n + PANEL - 1) / PANEL, failed = 0;
    int nb = k / t->elems;
    size_t row_bytes = (size_t)nb * t->bytes;
    float *xt = malloc(sizeof(float) * (size_t)k * lanes);
    if (!xt) return -1;
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        #pragma omp for schedule(static)
        for (int j = 0; j < k; j++)
            for (int i = 0; i < lanes; i++)
                xt[(size_t)j * lanes + i] = i < rows ? x[(size_t)i * k + j] : 0.f;
        float *buf = malloc(sizeof(float) * (size_t)PANEL * k);
        if (!buf) failed = 1;
        #pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            if (failed) continue;
            int c0 = p * PANEL, nw = n - c0 < PANEL ? n - c0 : PANEL;
            for (int r = 0; r < nw; r++)
                t->to_float(blocks + (size_t)(c0 + r) * row_bytes, nb, buf + (size_t)r * k);
            weight_panel(buf, nw, k, xt, lanes, rows, y + c0, n);
        }
        free(buf);
    }
    free(xt);
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------- entry points */

#ifdef HAS_GEMM8
/* gemm8 over round8's input in order (scales per `per`): its sums per 16 as they are (Q6_K);
 * Q4_K's for the mins added in pairs to per 32 (per 256) or times their scales (per 32) */
static int gemm8_call(const block_type *t, const int8_t *x8, const float *xs, int per,
                      const int16_t *bsum, int rows, int k, const uint8_t *w, int n, float *y,
                      int threads) {
    int16_t *sums = NULL;
    float *fs = NULL;
    size_t count = (size_t)rows * (k / 32);
    if (t->sums8 == 32 && per == 256) {
        sums = malloc(sizeof(int16_t) * count);
        if (!sums) return -1;
        for (size_t j = 0; j < count; j++) sums[j] = (int16_t)(bsum[2 * j] + bsum[2 * j + 1]);
    } else if (t->sums8 == 32) {
        fs = malloc(sizeof(float) * count);
        if (!fs) return -1;
        for (size_t j = 0; j < count; j++)  /* a scale per 32: one a sum */
            fs[j] = xs[j] * (float)(bsum[2 * j] + bsum[2 * j + 1]);
    }
    int failed = blocks_gemm8(t->build8, t->sums8 == 16, t->bytes, x8, xs, per,
                              sums ? sums : bsum, fs, rows, k, w, n, y, threads);
    free(sums);
    free(fs);
    return failed;
}
#endif

/* y (rows, n) = prepare(x) (rows, k) @ w.T, w the n weight rows of `type`'s blocks (each row
 * k / elems blocks, in the file's order); prepare as nbq_q4_matmul's (RMSNorm with `norm`,
 * NBQ_GATED); with NBQ_ROUND16, inputs of up to ROW_PATH_MAX rows (of any row count for a
 * type with build16: gemm16) are rounded to 16 bits per block of the type (round16) for the
 * integer kernels, where the build has them (AVX2, AVX-512); with NBQ_ROUND8, to 8 bits per
 * 256 (round8) for Q4_K's and Q6_K's on those builds, at any row count; with NBQ_ROUND8_MANY
 * alone, to 8 bits per 32 where gemm8 takes the rows (more than ROW_PATH_MAX); the flags
 * ignored elsewhere (other types, the plain C build: what the other flags give).
 * Returns 0, -1 when out of memory, -2 for a type not served or k not a multiple of its block. */
int nbq_blocks_matmul(const float *x, int rows, int k, int type, const void *blocks, int n,
                      float *y, int threads, const float *norm, float eps, int flags) {
    const block_type *t = type_of(type);
    if (!t || k <= 0 || k % t->elems || rows < 0 || n < 0) return -2;
    if (rows == 0 || n == 0) return 0;
    float *buf;
    x = prepare(x, rows, k, norm, eps, flags & NBQ_GATED, &buf, threads);
    if (!x) return -1;
    const uint8_t *w0 = blocks;
    size_t row_bytes = (size_t)(k / t->elems) * t->bytes;
    int failed = 0, nb = k / 32;
    int16_t *xq = NULL, *bsum = NULL;
    int8_t *x8 = NULL;
    float *xs = NULL, *xsum = NULL;
    /* gemm8: more than ROW_PATH_MAX rows with either 8-bit flag, where the build has it */
    __attribute__((unused)) int many8 = (flags & (NBQ_ROUND8 | NBQ_ROUND8_MANY)) && t->build8
                                        && rows > ROW_PATH_MAX;
    int rounds8 = ((flags & NBQ_ROUND8) && t->dot8) || many8;
    int rounds16 = (flags & NBQ_ROUND16) && t->dot16;
    int row_path = rows <= ROW_PATH_MAX || rounds8 || (rounds16 && (t->build16 || t->build32));
    /* 8 bits per 256 (NBQ_ROUND8: the row kernels, and decode batches in gemm8), or per 32
     * (NBQ_ROUND8_MANY alone: gemm8's prompt chunks) */
    __attribute__((unused)) int per = many8 && !(flags & NBQ_ROUND8) ? 32 : 256;
    if (row_path && rounds8) {  /* once a call */
        x8 = malloc((size_t)rows * k);
        xs = malloc(sizeof(float) * (size_t)rows * (k / per));
        bsum = malloc(sizeof(int16_t) * (size_t)rows * (k / 16));
        if (!x8 || !xs || !bsum) { free(x8); free(xs); free(bsum); free(buf); return -1; }
        ROUND8(x, rows, k, per, x8, xs, bsum, many8 ? 0 : Q4_K_ORDER(type), threads);
    } else if (row_path && rounds16) {  /* once a call */
        xq = malloc(sizeof(int16_t) * (size_t)rows * k);
        xs = malloc(sizeof(float) * (size_t)rows * nb);
        xsum = malloc(sizeof(float) * (size_t)rows * 2 * nb);
        if (!xq || !xs || !xsum) { free(xq); free(xs); free(xsum); free(buf); return -1; }
        round16(x, rows, k, t->elems, xq, xs, xsum);  /* per block of the type: 32 or 256 */
    }
    if (!row_path) {
        failed = blocks_panels(t, x, rows, k, w0, n, y, threads);
#ifdef HAS_GEMM32
    } else if (xq && t->build32 && rows > ROW_PATH_MAX) {
        failed = blocks_gemm32(t->build32, t->mins32, t->bytes, xq, xs, xsum, rows, k, w0, n, y,
                               threads);
#endif
#ifdef HAS_GEMM8
    } else if (many8) {
        failed = gemm8_call(t, x8, xs, per, bsum, rows, k, w0, n, y, threads);
#endif
#ifdef HAS_ROUNDED
    } else if (xq && t->build16 && rows > ROW_PATH_MAX) {
        failed = blocks_gemm16(t->build16, t->adds16, t->bytes, xq, xs, xsum, rows, k, w0, n, y,
                               threads);
#endif
    } else {
        dot_fn dot = t->dot;
        dot16_fn dot16 = t->dot16;
        dot8_fn dot8 = t->dot8;
        /* input rows a chunk at a time, so a chunk's rounded rows stay in L2 while every
         * weight row meets them. No software prefetch: the weight rows are read in order, which
         * the hardware prefetchers follow; asking for a whole row ahead (as quant_matmul.c
         * does for its smaller rows) filled the miss buffers and stalled a lone decode step */
        int chunk = rows <= ROW_PATH_MAX ? rows : x8 ? ROW_CHUNK : ROW_CHUNK / 2;  /* int16: 2x */
        #pragma omp parallel num_threads(threads)
        for (int c0 = 0; c0 < rows; c0 += chunk) {
            int c1 = rows - c0 < chunk ? rows : c0 + chunk;
            #pragma omp for schedule(static)
            for (int r = 0; r < n; r++) {
                const uint8_t *w = w0 + (size_t)r * row_bytes;
                for (int i0 = c0; i0 < c1; i0 += TILE) {
                    int tr = c1 - i0 < TILE ? c1 - i0 : TILE;
                    if (x8)
                        dot8(x8 + (size_t)i0 * k, xs + (size_t)i0 * (k / 256),
                             bsum + (size_t)i0 * (k / 16), tr, k, w, y + (size_t)i0 * n + r, n);
                    else if (xq)
                        dot16(xq + (size_t)i0 * k, xs + (size_t)i0 * (k / t->elems),
                              xsum + (size_t)i0 * 2 * nb,
                              tr, k, w, y + (size_t)i0 * n + r, n);
                    else
                        dot(x + (size_t)i0 * k, tr, k, w, y + (size_t)i0 * n + r, n);
                }
            }
        }
    }
    free(xq);
    free(x8);
    free(bsum);
    free(xs);
    free(xsum);
    free(buf);
    return failed;
}

/* out (count, k) = weight rows of `type`'s blocks as float32, exactly gguf's dequantization:
 * rows row_index[0..count) of the n_rows (an embedding lookup), or rows 0..count) when
 * row_index is NULL. Returns 0, or -2 for a type not served, k not a multiple of its block or
 * an index outside 0..n_rows). */
int nbq_blocks_dequantize(int type, const void *blocks, int n_rows, int k,
                          const int32_t *row_index, int count, float *out, int threads) {
    const block_type *t = type_of(type);
    if (!t || k <= 0 || k % t->elems || count < 0 || n_rows < 0) return -2;
    if (!row_index && count > n_rows) return -2;
    if (row_index)
        for (int i = 0; i < count; i++)
            if (row_index[i] < 0 || row_index[i] >= n_rows) return -2;
    int nb = k / t->elems;
    size_t row_bytes = (size_t)nb * t->bytes;
    #pragma omp parallel for schedule(static) num_threads(threads) if (count > 16)
    for (int i = 0; i < count; i++) {
        size_t r = (size_t)(row_index ? row_index[i] : i);
        t->to_float((const uint8_t *)blocks + r * row_bytes, nb, out + (size_t)i * k);
    }
    return 0;
}
