/* Matrix products over GGUF's own weight blocks, as the file stores them (ggml's block
 * layouts, llama.cpp ggml/src/ggml-common.h): each weight row of k inputs is k / QK blocks of
 * QK weights, one after the other, so a tensor's bytes can be used where the file maps them.
 *
 * One row per type in TYPES below, as ggml's type traits: the block's weights and bytes, its
 * dequantization to float32 and its dot with the input rows. The matmul never asks which type it
 * has; a new type is a block decoder (`<type>_block`, exactly gguf's `dequantize` arithmetic:
 * the same float32 operations in the same order, e.g. Q4_K's (d * sc) * q - dmin * m) and one
 * DEFINE_TYPE line.
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
 * Rounded mode (flag NBQ_ROUND16, AVX2 and AVX-512 builds, up to ROW_PATH_MAX input rows): the
 * input is rounded once per call to 16 bits per block of the weight type (32 inputs, or 256
 * for the K-quants and IQ4_XS, as llama.cpp's Q8_0 and Q8_K; round16, as quant_matmul.c's),
 * and every type's row kernel multiplies its codes with the input's in integers ("rounded
 * inputs" below). The product is then the one of gguf's weights with the rounded input, up to
 * float32 rounding: each input within max |x| / 65534 of its block's largest, never 8 bits per
 * block as llama.cpp's CPU kernels round (benchmarks/activation_rounding.py).
 */
#include "matmul_common.h"
#include "nbserve_kernels.h"
#if defined(__SSSE3__)
#include <tmmintrin.h>
#endif

#define TILE 4       /* input rows a row kernel multiplies per decoded block */
#define MAX_QK 256   /* the largest block (the K-quants', IQ4_XS's) */
#define N_TYPES 24   /* ggml type numbers below this */
#define PREFETCH_ROWS 4  /* as quant_matmul.c: the output row this many rows ahead is asked for */

typedef void (*to_float_fn)(const uint8_t *blocks, int nblocks, float *out);
typedef void (*dot_fn)(const float *x, int rows, int k, const uint8_t *w, float *out,
                       int n_out);
typedef void (*dot16_fn)(const int16_t *xq, const float *xs, const float *xsum, int rows, int k,
                         const uint8_t *w, float *out, int n_out);

/* One GGUF block type: `elems` weights in `bytes` bytes a block; to_float: `nblocks`
 * consecutive blocks as float32; dot: out[i * n_out] = x[i] . (the weight row w) for 1 to
 * TILE input rows of k. */
typedef struct {
    int elems, bytes;
    to_float_fn to_float;
    dot_fn dot;
    dot16_fn dot16;  /* the same over the input rounded to 16 bits (NBQ_ROUND16); NULL: none */
} block_type;

INLINE float half_at(const uint8_t *p) {  /* a float16 where a block stores one (any address) */
    half_t h;
    memcpy(&h, p, sizeof h);
    return h2f(h);
}

INLINE uint32_t u32_at(const uint8_t *p) {  /* a little-endian uint32 (x86 is) */
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1, 13, 25, 38, 53, 69, 89, 113};

/* ---------------------------------------------------------------- the block decoders
 * Each writes one block's QK weights to out, as gguf.quants.dequantize computes them. */

/* Q4_0 (18 bytes): d, 16 bytes of nibbles (byte j: weight j low, weight j + 16 high); d (q - 8) */
INLINE void q4_0_block(const uint8_t *b, float *out) {
    float d = half_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)((qs[j] & 15) - 8);
        out[j + 16] = d * (float)((qs[j] >> 4) - 8);
    }
}

/* Q4_1 (20 bytes): d, m, 16 bytes of nibbles; d q + m */
INLINE void q4_1_block(const uint8_t *b, float *out) {
    float d = half_at(b), m = half_at(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)(qs[j] & 15) + m;
        out[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

/* 16 values of IQ4_NL's table at the nibbles of 16 bytes (low ones, or high with shift 4) */
INLINE void iq4_lookup(const uint8_t *qs, int shift, int8_t *v) {
#if defined(__SSSE3__)
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    q = _mm_and_si128(shift ? _mm_srli_epi16(q, 4) : q, _mm_set1_epi8(15));
    __m128i table = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
    _mm_storeu_si128((__m128i *)v, _mm_shuffle_epi8(table, q));  /* 16 lookups at once */
#else
    for (int j = 0; j < 16; j++) v[j] = IQ4_VALUES[(qs[j] >> shift) & 15];
#endif
}

/* The 32 five-bit codes of Q5_0 and Q5_1: nibbles as Q4_0, bit j of qh on top of code j;
 * then out[j] = d * (q[j] - bias) (+ m where has_m), the float32 operations of gguf's. */
#if defined(__AVX2__)
/* 16 codes (bytes) to floats, as above */
INLINE void q5_floats(__m128i c, int bias, float d, float m, int has_m, float *out) {
    for (int half = 0; half < 2; half++) {
        __m256i v = _mm256_cvtepu8_epi32(half ? _mm_srli_si128(c, 8) : c);
        __m256 f = _mm256_mul_ps(_mm256_set1_ps(d),
                                 _mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(bias))));
        _mm256_storeu_ps(out + 8 * half, has_m ? _mm256_add_ps(f, _mm256_set1_ps(m)) : f);
    }
}

/* the codes of weights 0-15 (c[0]) and 16-31 (c[1]) as bytes */
INLINE void q5_codes16(const uint8_t *qs, uint32_t qh, __m128i *c) {
    /* each qh byte spread over 8 lanes, its bit j kept in lane j, as the fifth bit (16) */
    const __m128i bits = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    const __m128i low4 = _mm_set1_epi8(15), fifth = _mm_set1_epi8(16);
    __m128i h = _mm_cvtsi32_si128((int)qh);
    __m128i h0 = _mm_shuffle_epi8(h, _mm_set_epi64x(0x0101010101010101LL, 0));
    __m128i h1 = _mm_shuffle_epi8(h, _mm_set_epi64x(0x0303030303030303LL,
                                                    0x0202020202020202LL));
    h0 = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h0, bits), bits), fifth);
    h1 = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h1, bits), bits), fifth);
    __m128i n = _mm_loadu_si128((const __m128i *)qs);
    c[0] = _mm_or_si128(_mm_and_si128(n, low4), h0);
    c[1] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(n, 4), low4), h1);
}

INLINE void q5_block(const uint8_t *qs, uint32_t qh, int bias, float d, float m, int has_m,
                     float *out) {
    __m128i c[2];
    q5_codes16(qs, qh, c);
    q5_floats(c[0], bias, d, m, has_m, out);
    q5_floats(c[1], bias, d, m, has_m, out + 16);
}
#else
INLINE void q5_block(const uint8_t *qs, uint32_t qh, int bias, float d, float m, int has_m,
                     float *out) {
    for (int j = 0; j < 32; j++) {
        int q = ((qs[j % 16] >> (4 * (j / 16))) & 15) | (int)(((qh >> j) & 1u) << 4);
        float f = d * (float)(q - bias);
        out[j] = has_m ? f + m : f;
    }
}
#endif

/* Q5_0 (22 bytes): d, 32 fifth bits (uint32: bit j for weight j), nibbles as Q4_0; d (q - 16) */
INLINE void q5_0_block(const uint8_t *b, float *out) {
    q5_block(b + 6, u32_at(b + 2), 16, half_at(b), 0.f, 0, out);
}

/* Q5_1 (24 bytes): d, m, fifth bits, nibbles; d q + m */
INLINE void q5_1_block(const uint8_t *b, float *out) {
    q5_block(b + 8, u32_at(b + 4), 0, half_at(b), half_at(b + 2), 1, out);
}

/* Q8_0 (34 bytes): d, 32 signed bytes; q d */
INLINE void q8_0_block(const uint8_t *b, float *out) {
    float d = half_at(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) out[j] = (float)qs[j] * d;
}

/* IQ4_NL (18 bytes): d, nibbles as Q4_0 indexing a fixed table of 16 values; d value */
INLINE void iq4_nl_block(const uint8_t *b, float *out) {
    float d = half_at(b);
    int8_t v[32];
    iq4_lookup(b + 2, 0, v);
    iq4_lookup(b + 2, 4, v + 16);
    for (int j = 0; j < 32; j++) out[j] = d * (float)v[j];
}

/* Q2_K (84 bytes): 16 bytes of 4-bit scales (low) and mins (high) per 16 weights, 64 bytes of
 * 2-bit codes (byte l of half h: weights h 128 + s 32 + l at bits 2 s), d, dmin;
 * (d sc) q - (dmin m). The loops below go 16 weights (one scale) at a time. */
INLINE void q2_k_block(const uint8_t *b, float *out) {
    const uint8_t *sc = b;
    float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int g = 0; g < 2; g++) {
                int sb = h * 8 + s * 2 + g;
                float dl = d * (float)(sc[sb] & 15), ml = dmin * (float)(sc[sb] >> 4);
                const uint8_t *p = b + 16 + h * 32 + g * 16;
                float *o = out + sb * 16;
                for (int l = 0; l < 16; l++) o[l] = dl * (float)((p[l] >> (2 * s)) & 3) - ml;
            }
}

/* Q3_K (110 bytes): 32 bytes of high bits (bit g of byte l: weight g 32 + l; set: no - 4),
 * 64 bytes of 2-bit codes as Q2_K, 12 bytes of sixteen 6-bit scales (low nibbles in bytes
 * 0-7, two high bits in bytes 8-11), d; (d (sc - 32)) (q - 4 (1 - hbit)) */
INLINE void q3_k_block(const uint8_t *b, float *out) {
    const uint8_t *hm = b, *sc = b + 96;
    float d = half_at(b + 108);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int g = 0; g < 2; g++) {
                int sb = h * 8 + s * 2 + g, bit = h * 4 + s;
                int lo = sb < 8 ? sc[sb] & 15 : sc[sb - 8] >> 4;
                int hi = (sc[8 + sb % 4] >> (2 * (sb / 4))) & 3;
                float dl = d * (float)((int8_t)(lo | (hi << 4)) - 32);
                const uint8_t *p = b + 32 + h * 32 + g * 16, *m = hm + g * 16;
                float *o = out + sb * 16;
                for (int l = 0; l < 16; l++)
                    o[l] = dl * (float)(((p[l] >> (2 * s)) & 3) - 4 + 4 * ((m[l] >> bit) & 1));
            }
}

/* The 6-bit scales and mins of Q4_K and Q5_K's 8 sub-blocks of 32, from their 12 bytes, as 16
 * bytes: the 8 scales, then the 8 mins (four at a time in 32-bit words, as llama.cpp does) */
INLINE void k_scale_bytes(const uint8_t *s, uint8_t *out) {
    uint32_t u[4];
    memcpy(u, s, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    uint32_t mins_low = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins_low;
    u[0] &= 0x3f3f3f3fu;
    memcpy(out, u, 16);
}

INLINE void k_scales(const uint8_t *s, int *sc, int *mn) {
    uint8_t b[16];
    k_scale_bytes(s, b);
    for (int j = 0; j < 8; j++) {
        sc[j] = b[j];
        mn[j] = b[j + 8];
    }
}

/* Q4_K (144 bytes): d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles (byte l of
 * chunk c: weight c 64 + l low, c 64 + 32 + l high); (d sc) q - (dmin m) */
INLINE void q4_k_block(const uint8_t *b, float *out) {
    float d = half_at(b), dmin = half_at(b + 2), ds[8], dm[8];
    int sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    for (int i = 0; i < 8; i++) {
        ds[i] = d * (float)sc[i];
        dm[i] = dmin * (float)mn[i];
    }
    const uint8_t *qs = b + 16;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            out[c * 64 + l] = ds[2 * c] * (float)(qs[c * 32 + l] & 15) - dm[2 * c];
            out[c * 64 + 32 + l] = ds[2 * c + 1] * (float)(qs[c * 32 + l] >> 4) - dm[2 * c + 1];
        }
}

/* Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits before the nibbles (bit g of byte l:
 * weight g 32 + l) */
INLINE void q5_k_block(const uint8_t *b, float *out) {
    float d = half_at(b), dmin = half_at(b + 2), ds[8], dm[8];
    int sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    for (int i = 0; i < 8; i++) {
        ds[i] = d * (float)sc[i];
        dm[i] = dmin * (float)mn[i];
    }
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            int lo = (qs[c * 32 + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4);
            int hi = (qs[c * 32 + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
            out[c * 64 + l] = ds[2 * c] * (float)lo - dm[2 * c];
            out[c * 64 + 32 + l] = ds[2 * c + 1] * (float)hi - dm[2 * c + 1];
        }
}

/* Q6_K (210 bytes): 128 bytes of low nibbles (byte l of half h: weights h 128 + l and
 * h 128 + 64 + l), 64 bytes of high 2 bits (byte l of half h: weights h 128 + s 32 + l at bits
 * 2 s), 16 signed scales per 16 weights, d; (d sc) (q - 32), 16 weights (one scale) a loop */
INLINE void q6_k_block(const uint8_t *b, float *out) {
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_at(b + 208);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int g = 0; g < 2; g++) {
                int sb = h * 8 + s * 2 + g, shift_l = 4 * (s >> 1), shift_h = 2 * s;
                float ds = d * (float)sc[sb];
                const uint8_t *ql = b + h * 64 + (s & 1) * 32 + g * 16;
                const uint8_t *qh = b + 128 + h * 32 + g * 16;
                float *o = out + sb * 16;
                for (int l = 0; l < 16; l++) {
                    int q = ((ql[l] >> shift_l) & 15) | (((qh[l] >> shift_h) & 3) << 4);
                    o[l] = ds * (float)(q - 32);
                }
            }
}

/* IQ4_XS (136 bytes): d, 16 bits of scales' high 2 bits, 4 bytes of their low nibbles, 128
 * bytes of nibbles (16 per sub-block of 32, Q4_0's order) indexing IQ4_NL's table;
 * (d (sc - 32)) value */
INLINE void iq4_xs_block(const uint8_t *b, float *out) {
    float d = half_at(b);
    int sh = b[2] | (b[3] << 8);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
        float dl = d * (float)(ls - 32);
        int8_t v[32];
        iq4_lookup(qs + ib * 16, 0, v);
        iq4_lookup(qs + ib * 16, 4, v + 16);
        for (int j = 0; j < 32; j++) out[ib * 32 + j] = dl * (float)v[j];
    }
}

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

#if defined(HAS_DIRECT_DOTS) && (VL == 8 || defined(__AVX512BW__))
/* ---------------------------------------------------------------- rounded inputs (NBQ_ROUND16)
 * The integer row kernels: the input rounded once per call to 16 bits per block of the type
 * (round16, matmul_common.h: codes xq, scales xs, and the rounded input's sums per 16, xsum),
 * and each weight taken as scale * (mul * code) + add: code a signed byte from the block (32
 * of them a chunk, in input order), mul an integer per 16 weights folded into the codes as
 * int16 (the 256-weight types' sub-block scales; 1 elsewhere), scale a float (d), add a float
 * per 16 weights (- dmin m, or m; 0 for types without). A chunk's products with the input's
 * codes are integers, exact in int32 (vpmaddwd); the adds meet the rounded input's sums. So the
 * product is the one of the exact weights with the rounded input, up to float32 rounding.
 * The 32-weight types convert each chunk's sum at once (its input block has its own scale, so
 * vpdpwssd would save nothing there); the 256-weight ones add a block's up first (below). */
#define HAS_ROUNDED 1
typedef struct {
    float scale[8], add[16];  /* per chunk of 32; per 16 weights */
    int16_t mul[16];          /* per 16 weights */
} block16;

#if VL == 16
typedef __m512i w16;  /* a chunk's 32 weights as int16 */
INLINE w16 widen(__m256i b) { return _mm512_cvtepi8_epi16(b); }
INLINE w16 mul16(w16 w, const int16_t *mul, int c) {  /* by mul[2c] (weights 0-15), mul[2c + 1] */
    __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)),
                                     _mm256_set1_epi16((short)(2 * c + 1)), 1);
    __m512i all = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)mul));
    return _mm512_mullo_epi16(w, _mm512_permutexvar_epi16(idx, all));
}
INLINE vi idot(w16 w, const int16_t *x) {  /* 16 lanes, each two products summed */
    return _mm512_madd_epi16(w, _mm512_loadu_si512((const void *)x));
}
#else
typedef struct { __m256i lo, hi; } w16;
INLINE w16 widen(__m256i b) {
    w16 r = {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(b)),
             _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1))};
    return r;
}
INLINE w16 mul16(w16 w, const int16_t *mul, int c) {
    w.lo = _mm256_mullo_epi16(w.lo, _mm256_set1_epi16(mul[2 * c]));
    w.hi = _mm256_mullo_epi16(w.hi, _mm256_set1_epi16(mul[2 * c + 1]));
    return w;
}
INLINE vi idot(w16 w, const int16_t *x) {  /* 8 lanes, each four products summed */
    return _mm256_add_epi32(_mm256_madd_epi16(w.lo, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(w.hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}
#endif

INLINE __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE __m256i bits_at(const uint8_t *p, int shift, int mask) {  /* (byte >> shift) & mask */
    return _mm256_and_si256(_mm256_srli_epi16(load32(p), shift), _mm256_set1_epi8((char)mask));
}

/* The 32-weight types: one chunk, the codes of *_codes above less the bias */
#define CHUNK32(T, BIAS)                                                                        \
    INLINE __m256i T##_chunk(const uint8_t *blk, int c) {                                       \
        (void)c;                                                                                \
        __m128i h[2];                                                                           \
        T##_codes(blk, h);                                                                      \
        return _mm256_sub_epi8(_mm256_set_m128i(h[1], h[0]), _mm256_set1_epi8(BIAS));           \
    }
CHUNK32(q4_0, 8)
CHUNK32(q4_1, 0)
CHUNK32(q5_0, 16)
CHUNK32(q5_1, 0)
CHUNK32(q8_0, 0)
CHUNK32(iq4_nl, 0)
INLINE void d_prep(const uint8_t *blk, block16 *p) { p->scale[0] = half_at(blk); }
INLINE void dm_prep(const uint8_t *blk, block16 *p) {  /* d q + m */
    p->scale[0] = half_at(blk);
    p->add[0] = p->add[1] = half_at(blk + 2);
}
#define q4_0_prep d_prep
#define q5_0_prep d_prep
#define q8_0_prep d_prep
#define iq4_nl_prep d_prep
#define q4_1_prep dm_prep
#define q5_1_prep dm_prep

/* Q4_K and Q5_K: chunk c is sub-block c, d (sc q) - dmin m */
INLINE void k45_prep(const uint8_t *blk, block16 *p) {
    uint8_t b[16];
    k_scale_bytes(blk + 4, b);
    __m128i bytes = _mm_loadu_si128((const __m128i *)b);
    __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
    p->scale[0] = half_at(blk);  /* d; sc as mul, each twice (per 16 weights) */
    _mm256_storeu_si256((__m256i *)p->mul, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(bytes, bytes)));
    mn = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(half_at(blk + 2)), mn),
                       _mm256_set1_ps(-0.f));  /* - dmin m, each twice (per 16 weights) */
    __m256 lo = _mm256_unpacklo_ps(mn, mn), hi = _mm256_unpackhi_ps(mn, mn);
    _mm256_storeu_ps(p->add, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(p->add + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}
#define q4_k_prep k45_prep
#define q5_k_prep k45_prep
INLINE __m256i q4_k_chunk(const uint8_t *blk, int c) {
    return bits_at(blk + 16 + (c / 2) * 32, 4 * (c & 1), 15);
}
INLINE __m256i q5_k_chunk(const uint8_t *blk, int c) {
    __m256i fifth = _mm256_slli_epi16(bits_at(blk + 16, c, 1), 4);
    return _mm256_or_si256(bits_at(blk + 48 + (c / 2) * 32, 4 * (c & 1), 15), fifth);
}

/* Q6_K: d, sc as mul, q - 32 (see q6_k_block: chunk c = half c / 4, s = c % 4) */
INLINE void q6_k_prep(const uint8_t *blk, block16 *p) {
    float d = half_at(blk + 208);
    for (int c = 0; c < 8; c++) p->scale[c] = d;
    for (int sb = 0; sb < 16; sb++) p->mul[sb] = ((const int8_t *)(blk + 192))[sb];
}
INLINE __m256i q6_k_chunk(const uint8_t *blk, int c) {
    int h = c / 4, s = c % 4;
    __m256i lo = bits_at(blk + h * 64 + (s & 1) * 32, 4 * (s >> 1), 15);
    __m256i hi = _mm256_slli_epi16(bits_at(blk + 128 + h * 32, 2 * s, 3), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

/* Q2_K: d, sc as mul, - dmin m as add (see q2_k_block) */
INLINE void q2_k_prep(const uint8_t *blk, block16 *p) {
    float d = half_at(blk + 80), dmin = half_at(blk + 82);
    for (int c = 0; c < 8; c++) p->scale[c] = d;
    for (int sb = 0; sb < 16; sb++) {
        p->mul[sb] = blk[sb] & 15;
        p->add[sb] = -(dmin * (float)(blk[sb] >> 4));
    }
}
INLINE __m256i q2_k_chunk(const uint8_t *blk, int c) {
    return bits_at(blk + 16 + (c / 4) * 32, 2 * (c % 4), 3);
}

/* Q3_K: d, sc - 32 as mul, q - 4 (1 - hbit) (see q3_k_block) */
INLINE void q3_k_prep(const uint8_t *blk, block16 *p) {
    const uint8_t *sc = blk + 96;
    float d = half_at(blk + 108);
    for (int c = 0; c < 8; c++) p->scale[c] = d;
    for (int sb = 0; sb < 16; sb++) {
        int lo = sb < 8 ? sc[sb] & 15 : sc[sb - 8] >> 4;
        int hi = (sc[8 + sb % 4] >> (2 * (sb / 4))) & 3;
        p->mul[sb] = (int16_t)((int8_t)(lo | (hi << 4)) - 32);
    }
}
INLINE __m256i q3_k_chunk(const uint8_t *blk, int c) {
    int h = c / 4, s = c % 4;
    __m256i q = bits_at(blk + 32 + h * 32, 2 * s, 3);
    __m256i high = _mm256_slli_epi16(bits_at(blk, h * 4 + s, 1), 2);
    return _mm256_sub_epi8(_mm256_add_epi8(q, high), _mm256_set1_epi8(4));
}

/* IQ4_XS: d, ls - 32 as mul, the table's values (see iq4_xs_block) */
INLINE void iq4_xs_prep(const uint8_t *blk, block16 *p) {
    int sh = blk[2] | (blk[3] << 8);
    p->scale[0] = half_at(blk);
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
        p->mul[2 * ib] = p->mul[2 * ib + 1] = (int16_t)(ls - 32);
    }
}
INLINE __m256i iq4_xs_chunk(const uint8_t *blk, int c) {
    __m128i h[2];
    iq4_codes16(blk + 8 + c * 16, h);
    return _mm256_set_m128i(h[1], h[0]);
}

/* lane c of f in every lane */
INLINE vf lane_of(__m256 f, int c) {
#if VL == 16
    return _mm512_permutexvar_ps(_mm512_set1_epi32(c), _mm512_castps256_ps512(f));
#else
    return _mm256_permutevar8x32_ps(f, _mm256_set1_epi32(c));
#endif
}

/* a[0..] += add (16 floats) times su (16 floats) */
INLINE void add16(const float *add, const float *su, vf *a) {
    for (int h = 0; h < 16 / VL; h++) a[h] = vfma(vload(add + h * VL), vload(su + h * VL), a[h]);
}

#define DOT16_BY_ROWS(T)                                                                         \
    static void T##_dot16(const int16_t *xq, const float *xs, const float *xsum, int rows, int k, \
                          const uint8_t *w, float *out, int n_out) {                             \
        switch (rows) {                                                                          \
        case 1: T##_dot16_n(xq, xs, xsum, 1, k, w, out, n_out); break;                          \
        case 2: T##_dot16_n(xq, xs, xsum, 2, k, w, out, n_out); break;                          \
        case 3: T##_dot16_n(xq, xs, xsum, 3, k, w, out, n_out); break;                          \
        default: T##_dot16_n(xq, xs, xsum, TILE, k, w, out, n_out);                             \
        }                                                                                        \
    }

/* The 256-weight types (the K-quants, IQ4_XS): the input rounded per 256 (one scale a block, as
 * llama.cpp's Q8_K) and every weight d * (mul * code) + add with an integer mul per 16 weights
 * (a sub-block's scale), so that a block's products add up in int32 (|mul code| <= 4096: on
 * AVX-512 a lane sums 16 products, below 2^31; on AVX2 32, so there the sums are converted
 * every 4 chunks) before one conversion and FMA by d times the input's scale; vpdpwssd where
 * the CPU has AVX-512 VNNI. The adds meet the rounded input's sums per 16. */
#if VL == 16
INLINE vi izero(void) { return _mm512_setzero_si512(); }
INLINE vi iacc(vi acc, w16 w, const int16_t *x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, _mm512_loadu_si512((const void *)x));
#else
    return _mm512_add_epi32(acc, idot(w, x));
#endif
}
#define FLUSH_EVERY 8
#else
INLINE vi izero(void) { return _mm256_setzero_si256(); }
INLINE vi iacc(vi acc, w16 w, const int16_t *x) { return _mm256_add_epi32(acc, idot(w, x)); }
#define FLUSH_EVERY 4
#endif
#define ROUNDED256(T, BYTES, ADD)                                                                \
    INLINE void T##_dot16_n(const int16_t *xq, const float *xs, const float *xsum, int rows,     \
                            int k, const uint8_t *w, float *out, int n_out) {                    \
        vf acc[TILE], adds[TILE][16 / VL];                                                       \
        int nb = k / 256;                                                                        \
        for (int i = 0; i < TILE; i++) {                                                         \
            acc[i] = vzero();                                                                    \
            for (int h = 0; h < 16 / VL; h++) adds[i][h] = vzero();                              \
        }                                                                                        \
        for (int b = 0; b < nb; b++) {                                                           \
            const uint8_t *blk = w + (size_t)b * (BYTES);                                        \
            block16 p;                                                                           \
            vi isum[TILE];                                                                       \
            T##_prep(blk, &p);                                                                   \
            for (int i = 0; i < rows; i++) {                                                     \
                isum[i] = izero();                                                               \
                if (ADD) add16(p.add, xsum + (size_t)i * (k / 16) + (size_t)b * 16, adds[i]);    \
            }                                                                                    \
            _Pragma("GCC unroll 8")                                                              \
            for (int c = 0; c < 8; c++) {                                                        \
                w16 wv = mul16(widen(T##_chunk(blk, c)), p.mul, c);                              \
                const int16_t *xc = xq + (size_t)(b * 8 + c) * 32;                               \
                for (int i = 0; i < rows; i++) isum[i] = iacc(isum[i], wv, xc + (size_t)i * k); \
                if (c % FLUSH_EVERY == FLUSH_EVERY - 1)                                          \
                    for (int i = 0; i < rows; i++) {                                             \
                        vf f = vset(p.scale[0] * xs[(size_t)i * nb + b]);                        \
                        acc[i] = vfma(vfloat(isum[i]), f, acc[i]);                               \
                        isum[i] = izero();                                                       \
                    }                                                                            \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < rows; i++) {                                                         \
            float a = 0.f;                                                                       \
            for (int h = 0; h < 16 / VL; h++) a += vsum(adds[i][h]);                             \
            out[(size_t)i * n_out] = vsum(acc[i]) + a;                                           \
        }                                                                                        \
    }                                                                                            \
    DOT16_BY_ROWS(T)

/* T_dot16_n: the rounded input's rows xq (rows, k), xs (rows, k / 32), xsum (rows, k / 16)
 * times one weight row, for a constant row count; MUL: whether the type has integer factors;
 * ADD: whether it has adds. Per block of 256, each row's chunk factors (scale times the input
 * block's scale) and the adds' dot with the input's sums are vector operations; per chunk, the
 * codes are built once for every row, and each row takes one integer multiply-add, a
 * conversion and an FMA (two accumulators a row, so that the FMA chains interleave). */
#define ROUNDED(T, QK, BYTES, MUL, ADD)                                                          \
    INLINE void T##_dot16_n(const int16_t *xq, const float *xs, const float *xsum, int rows,     \
                            int k, const uint8_t *w, float *out, int n_out) {                    \
        enum { NC = (QK) / 32 };                                                                 \
        vf acc[TILE][2], adds[TILE][16 / VL];                                                    \
        float add1[TILE];                                                                        \
        int nb = k / 32;                                                                         \
        for (int i = 0; i < TILE; i++) {                                                         \
            acc[i][0] = acc[i][1] = vzero();                                                     \
            for (int h = 0; h < 16 / VL; h++) adds[i][h] = vzero();                              \
            add1[i] = 0.f;                                                                       \
        }                                                                                        \
        for (int b = 0; b < k / (QK); b++) {                                                     \
            const uint8_t *blk = w + (size_t)b * (BYTES);                                        \
            block16 p;                                                                           \
            __m256 f[TILE];                                                                      \
            T##_prep(blk, &p);                                                                   \
            for (int i = 0; i < rows; i++) {                                                     \
                const float *si = xs + (size_t)i * nb + (size_t)b * NC;                          \
                const float *su = xsum + (size_t)i * 2 * nb + (size_t)b * 2 * NC;                \
                if (NC == 8) {                                                                   \
                    f[i] = _mm256_mul_ps(_mm256_loadu_ps(p.scale), _mm256_loadu_ps(si));         \
                    if (ADD) add16(p.add, su, adds[i]);                                          \
                } else {                                                                         \
                    f[i] = _mm256_set1_ps(p.scale[0] * si[0]);                                   \
                    if (ADD) add1[i] += p.add[0] * su[0] + p.add[1] * su[1];                     \
                }                                                                                \
            }                                                                                    \
            _Pragma("GCC unroll 8")                                                              \
            for (int c = 0; c < NC; c++) {                                                       \
                w16 wv = widen(T##_chunk(blk, c));                                               \
                if (MUL) wv = mul16(wv, p.mul, c);                                               \
                const int16_t *xc = xq + (size_t)(b * NC + c) * 32;                              \
                for (int i = 0; i < rows; i++) {                                                 \
                    vf fc = NC == 8 ? lane_of(f[i], c) : vset(_mm256_cvtss_f32(f[i]));           \
                    acc[i][c & 1] = vfma(vfloat(idot(wv, xc + (size_t)i * k)), fc,               \
                                         acc[i][c & 1]);                                         \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < rows; i++) {                                                         \
            float a = add1[i];                                                                   \
            for (int h = 0; h < 16 / VL; h++) a += vsum(adds[i][h]);                             \
            out[(size_t)i * n_out] = vsum(acc[i][0]) + vsum(acc[i][1]) + a;                     \
        }                                                                                        \
    }                                                                                            \
    DOT16_BY_ROWS(T)
ROUNDED(q4_0, 32, 18, 0, 0)
ROUNDED(q4_1, 32, 20, 0, 1)
ROUNDED(q5_0, 32, 22, 0, 0)
ROUNDED(q5_1, 32, 24, 0, 1)
ROUNDED(q8_0, 32, 34, 0, 0)
ROUNDED(iq4_nl, 32, 18, 0, 0)
ROUNDED256(q2_k, 84, 1)
ROUNDED256(q3_k, 110, 0)
ROUNDED256(q4_k, 144, 1)
ROUNDED256(q5_k, 176, 1)
ROUNDED256(q6_k, 210, 0)
ROUNDED256(iq4_xs, 136, 0)
#define DOT16(T) T##_dot16
#else
#define DOT16(T) NULL
#endif

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

/* The served types by ggml number (enum nbq_ggml_type); elems 0: not served. */
static const block_type TYPES[N_TYPES] = {
    [NBQ_GGML_Q4_0] = {32, 18, q4_0_to_float, q4_0_dot, DOT16(q4_0)},
    [NBQ_GGML_Q4_1] = {32, 20, q4_1_to_float, q4_1_dot, DOT16(q4_1)},
    [NBQ_GGML_Q5_0] = {32, 22, q5_0_to_float, q5_0_dot, DOT16(q5_0)},
    [NBQ_GGML_Q5_1] = {32, 24, q5_1_to_float, q5_1_dot, DOT16(q5_1)},
    [NBQ_GGML_Q8_0] = {32, 34, q8_0_to_float, q8_0_dot, DOT16(q8_0)},
    [NBQ_GGML_Q2_K] = {256, 84, q2_k_to_float, q2_k_dot, DOT16(q2_k)},
    [NBQ_GGML_Q3_K] = {256, 110, q3_k_to_float, q3_k_dot, DOT16(q3_k)},
    [NBQ_GGML_Q4_K] = {256, 144, q4_k_to_float, q4_k_dot, DOT16(q4_k)},
    [NBQ_GGML_Q5_K] = {256, 176, q5_k_to_float, q5_k_dot, DOT16(q5_k)},
    [NBQ_GGML_Q6_K] = {256, 210, q6_k_to_float, q6_k_dot, DOT16(q6_k)},
    [NBQ_GGML_IQ4_NL] = {32, 18, iq4_nl_to_float, iq4_nl_dot, DOT16(iq4_nl)},
    [NBQ_GGML_IQ4_XS] = {256, 136, iq4_xs_to_float, iq4_xs_dot, DOT16(iq4_xs)},
};

static const block_type *type_of(int type) {
    return type >= 0 && type < N_TYPES && TYPES[type].elems ? &TYPES[type] : NULL;
}

int nbq_blocks_supported(int type) { return type_of(type) != NULL; }

int nbq_block_elems(int type) { return type_of(type) ? type_of(type)->elems : 0; }

int nbq_block_bytes(int type) { return type_of(type) ? type_of(type)->bytes : 0; }

int nbq_blocks_rounded(int type) { return type_of(type) && type_of(type)->dot16 ? 1 : 0; }

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

/* y (rows, n) = prepare(x) (rows, k) @ w.T, w the n weight rows of `type`'s blocks (each row
 * k / elems blocks, in the file's order); prepare as nbq_q4_matmul's (RMSNorm with `norm`,
 * NBQ_GATED); with NBQ_ROUND16, inputs of up to ROW_PATH_MAX rows are rounded to 16 bits per
 * block of the type (round16) for the integer row kernels, where the build has them (AVX2,
 * AVX-512).
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
    int16_t *xq = NULL;
    float *xs = NULL, *xsum = NULL;
    if (rows <= ROW_PATH_MAX && (flags & NBQ_ROUND16) && t->dot16) {  /* rounded once a call */
        xq = malloc(sizeof(int16_t) * (size_t)rows * k);
        xs = malloc(sizeof(float) * (size_t)rows * nb);
        xsum = malloc(sizeof(float) * (size_t)rows * 2 * nb);
        if (!xq || !xs || !xsum) { free(xq); free(xs); free(xsum); free(buf); return -1; }
        round16(x, rows, k, t->elems, xq, xs, xsum);  /* per block of the type: 32 or 256 */
    }
    if (rows > ROW_PATH_MAX) {
        failed = blocks_panels(t, x, rows, k, w0, n, y, threads);
    } else {
        dot_fn dot = t->dot;
        dot16_fn dot16 = t->dot16;
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int r = 0; r < n; r++) {
            const uint8_t *w = w0 + (size_t)r * row_bytes;
            if (r + PREFETCH_ROWS < n) {
                const uint8_t *ahead = w + PREFETCH_ROWS * row_bytes;
                for (size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(ahead + o, 0, 3);
            }
            for (int i0 = 0; i0 < rows; i0 += TILE) {
                int tr = rows - i0 < TILE ? rows - i0 : TILE;
                if (xq)
                    dot16(xq + (size_t)i0 * k, xs + (size_t)i0 * (k / t->elems),
                          xsum + (size_t)i0 * 2 * nb,
                          tr, k, w, y + (size_t)i0 * n + r, n);
                else
                    dot(x + (size_t)i0 * k, tr, k, w, y + (size_t)i0 * n + r, n);
            }
        }
    }
    free(xq);
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
