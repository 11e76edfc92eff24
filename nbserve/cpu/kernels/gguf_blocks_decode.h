/* The block decoders of gguf_blocks.c, which includes this file once (kept apart for length):
 * each writes one block's QK weights to out, as gguf.quants.dequantize computes them, with the
 * helpers they share (a block's float16 and uint32 reads, the IQ4 table and its lookup, Q5's
 * high bits). */

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

