/* gguf_blocks.c's 8-bit input row kernels (NBQ_ROUND8) for Q4_K and Q6_K, included once by it
 * after gguf_blocks_round16.h (whose small helpers they use; built where those kernels are:
 * AVX2, AVX-512 with BW); DOT8(T) names a type's kernel, NULL on a build without them.
 *
 * The input is rounded once per call to 8 bits per 256 (round8, the arithmetic of llama.cpp's
 * Q8_K: a float scale s = max |x| / 127 a block, codes rint(x / s) in [-127, 127], the codes'
 * sums per 16). A weight block's unsigned codes (Q4_K's 4 bits, Q6_K's 6) meet the input's
 * signed ones in vpmaddubsw (u8 x s8, two products a 16-bit lane: at most 2 * 63 * 127 = 16002,
 * never saturating), then vpmaddwd (vpdpwssd with AVX-512 VNNI) by the sub-block scale as int16,
 * so a block's 256 products add up in int32 (Q6_K: |sc| <= 128, at most 2^28 a lane; Q4_K
 * less) before one conversion and FMA by d times the input's scale. What the codes leave out
 * goes through the input codes' sums per 16: Q6_K's - 32 as - 32 sc times them, in the same
 * int32 sums; Q4_K's - dmin m as m times them (vpmaddwd), converted and multiplied by dmin
 * times the input's scale. On AVX-512, Q4_K's 64 low (high) nibbles of 64 bytes are weights
 * 0-31 and 64-95 (32-63 and 96-127) of 128: round8 lays the input out in that order, so the
 * codes need no shuffle.
 * So the product is the one of gguf's weights with the 8-bit input, up to float32 rounding;
 * the input is within s / 2 = max |x| / 254 of x a block, 258 times the 16-bit rounding's step
 * (benchmarks/activation_rounding.py measures what that does to answers). */
#if defined(HAS_ROUNDED)
#define HAS_ROUND8 1

/* x (rows, k) to 8 bits per `per` inputs (256: the row kernels', llama.cpp's Q8_K; 32: gemm8's):
 * q (rows, k) codes, s (rows, k / per) scales max |x| / 127, bsum (rows, k / 16) each 16 codes'
 * sum (in the input's order). `swap`: q holds each 128 inputs' 32-input quarters in the order
 * 0, 2, 1, 3 (Q4_K_ORDER). */
static void round8(const float *x, int rows, int k, int per, int8_t *q, float *s, int16_t *bsum,
                   int swap, int threads) {
    int nb = k / 256, groups = 256 / per;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > ROW_PATH_MAX)
    for (int i = 0; i < rows; i++)
        for (int b = 0; b < nb; b++) {
            const float *v = x + (size_t)i * k + (size_t)b * 256;
            int8_t o[256];
            __m256 sign = _mm256_set1_ps(-0.f);
            for (int g = 0; g < groups; g++) {
                __m256 m = _mm256_setzero_ps();
                for (int j = per * g; j < per * (g + 1); j += 8)
                    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
                __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
                m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
                float inv = amax > 0.f ? 127.f / amax : 0.f;
                __m256 vinv = _mm256_set1_ps(inv);
                for (int j = per * g; j < per * (g + 1); j += 32) {  /* cvtps: to nearest even */
                    __m256i c[4];
                    for (int u = 0; u < 4; u++)
                        c[u] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j + 8 * u), vinv));
                    __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                                   _mm256_packs_epi32(c[2], c[3]));
                    /* the packs interleave 4-byte groups of the 128-bit lanes: put them back */
                    w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                    _mm256_storeu_si256((__m256i *)(o + j),
                                        _mm256_max_epi8(w, _mm256_set1_epi8(-127)));
                }
                s[(size_t)i * (k / per) + (size_t)b * groups + g] = amax / 127.f;
            }
            for (int h = 0; h < 16; h++) {
                int total = 0;
                for (int j = 0; j < 16; j++) total += o[16 * h + j];
                bsum[(size_t)i * (k / 16) + (size_t)b * 16 + h] = (int16_t)total;
            }
            for (int j = 0; j < 256; j += 32) {
                int from = swap && (j / 32) % 4 % 3 ? j ^ 96 : j;  /* quarters 1 and 2 swap */
                memcpy(q + (size_t)i * k + (size_t)b * 256 + j, o + from, 32);
            }
        }
}

#if VL == 16
typedef __m512i v8;  /* 64 codes */
INLINE v8 load64(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
INLINE v8 nib(v8 v, int shift) {  /* (byte >> shift) & 15 */
    return _mm512_and_si512(_mm512_srli_epi16(v, shift), _mm512_set1_epi8(15));
}
/* the int16 scales of 64 inputs p (0-3) of a block: in 128-bit lane L (16 inputs), mul[j]
 * eight times, j = 8 (p / 2) + pick[p % 2][L], shuffled out of half[p / 2] (mul[0-7] or
 * mul[8-15] in every 128-bit lane) */
#define W2(j) 2 * (j), 2 * (j) + 1
#define W16(j) W2(j), W2(j), W2(j), W2(j), W2(j), W2(j), W2(j), W2(j)
#define PICKS(a, b, c, d) {W16(a), W16(b), W16(c), W16(d)}
static const int8_t Q6_K_PICK[2][64] = {PICKS(0, 1, 2, 3), PICKS(4, 5, 6, 7)};
static const int8_t Q4_K_PICK[2][64] = {PICKS(0, 0, 4, 4), PICKS(2, 2, 6, 6)};  /* Q4_K_ORDER */
INLINE __m512i scales64(const __m512i *half, const int8_t pick[2][64], int p) {
    return _mm512_shuffle_epi8(half[p / 2], _mm512_loadu_si512((const void *)pick[p % 2]));
}
/* acc + (w . x) by the scales: 16 lanes, each 4 products */
INLINE vi idot8(vi acc, v8 w, const int8_t *x, __m512i sc) {
    __m512i pairs = _mm512_maddubs_epi16(w, _mm512_loadu_si512((const void *)x));
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, pairs, sc);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, sc));
#endif
}
INLINE vi widen_sum(__m256i v) { return _mm512_zextsi256_si512(v); }
#define STEP 64
#else
typedef __m256i v8;  /* 32 codes */
INLINE __m256i scales32(const int16_t *mul, int c) {  /* mul[2c] x 8, mul[2c + 1] x 8 */
    return _mm256_set_m128i(_mm_set1_epi16(mul[2 * c + 1]), _mm_set1_epi16(mul[2 * c]));
}
INLINE vi idot8(vi acc, v8 w, const int8_t *x, __m256i sc) {  /* 8 lanes, each 4 products */
    __m256i pairs = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, sc));
}
INLINE vi widen_sum(__m256i v) { return v; }
#define STEP 32
#endif

/* A block's factors: d, the sub-block scales per 16 weights (int16; Q4_K's each twice) and
 * Q4_K's dmin and mins per 16 weights (int16, each twice). */
typedef struct {
    float d, dmin;
    __m256i mul, mins;
} block8;
/* k_scale_bytes in registers: the block's first 16 bytes as 32-bit lanes [d dmin, u0, u1, u2]
 * to sc 0-3 = u0 & 0x3f.., sc 4-7 = (u2 & 0x0f..) | (u0 >> 6 & 3..) << 4, m 0-3 = u1 & 0x3f..,
 * m 4-7 = (u2 >> 4 & 0x0f..) | (u1 >> 6 & 3..) << 4 (a byte's bits 6-7 reach 4-5 by >> 2) */
INLINE __m128i q4_k_scales8(const uint8_t *blk) {
    __m128i v = _mm_loadu_si128((const __m128i *)blk);
    __m128i low = _mm_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 1));   /* u0, u2, u1, u2 */
    __m128i high = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 1, 1));  /* u0, u0, u1, u1 */
    low = _mm_and_si128(_mm_srlv_epi32(low, _mm_setr_epi32(0, 0, 0, 4)),
                        _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    high = _mm_and_si128(_mm_srli_epi32(high, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(low, high);
}
INLINE void q4_k_prep8(const uint8_t *blk, block8 *p) {
    __m128i bytes = q4_k_scales8(blk);  /* sc 0-7, m 0-7 */
    p->d = half_at(blk);
    p->dmin = half_at(blk + 2);
    p->mul = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(bytes, bytes));
    p->mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(bytes, bytes));
}
INLINE void q6_k_prep8(const uint8_t *blk, block8 *p) {
    p->d = half_at(blk + 208);
    p->dmin = 0.f;
    p->mul = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    p->mins = _mm256_setzero_si256();
}

/* Q4_K: qs byte j of 32-byte group c holds sub-blocks 2c (low nibble) and 2c + 1 (high) */
INLINE void q4_k_codes8(const uint8_t *blk, v8 *w) {  /* 256 codes, in round8's order */
    const uint8_t *qs = blk + 16;
#if VL == 16
    for (int h = 0; h < 2; h++) {  /* 64 bytes: sub-blocks 4h, 4h + 2 low, 4h + 1, 4h + 3 high */
        v8 v = load64(qs + 64 * h);
        w[2 * h] = nib(v, 0);
        w[2 * h + 1] = nib(v, 4);
    }
#else
    for (int c = 0; c < 4; c++) {
        w[2 * c] = bits_at(qs + 32 * c, 0, 15);
        w[2 * c + 1] = bits_at(qs + 32 * c, 4, 15);
    }
#endif
}

/* Q6_K (see q6_k_chunk): chunk c = half c / 4, s = c % 4; codes q without the - 32 */
INLINE void q6_k_codes8(const uint8_t *blk, v8 *w) {
#if VL == 16
    for (int p = 0; p < 4; p++) {  /* chunks 2p, 2p + 1: h = p / 2, s = 2 (p % 2) and s + 1 */
        int h = p / 2, s = 2 * (p % 2);
        v8 lo = nib(load64(blk + h * 64), 4 * (p % 2));
        __m512i qh = _mm512_broadcast_i64x4(load32(blk + 128 + h * 32));
        __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * s)),
                                           _mm256_set1_epi16((short)(2 * s + 2)), 1);
        qh = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), _mm512_set1_epi8(3));
        w[p] = _mm512_or_si512(lo, _mm512_slli_epi16(qh, 4));
    }
#else
    for (int c = 0; c < 8; c++) {
        int h = c / 4, s = c % 4;
        __m256i lo = bits_at(blk + h * 64 + (s & 1) * 32, 4 * (s >> 1), 15);
        w[c] = _mm256_or_si256(lo, _mm256_slli_epi16(bits_at(blk + 128 + h * 32, 2 * s, 3), 4));
    }
#endif
}

/* T_dot8_n: the 8-bit input's rows xq (rows, k), xs (rows, k / 256) and bsum (rows, k / 16)
 * times one weight row, for a constant row count. Per block: the codes and scales once for
 * every row; per row and 64 (AVX-512) or 32 (AVX2) weights, one vpmaddubsw and one vpdpwssd
 * (AVX2: vpmaddwd and an add); per row and block, a conversion and an FMA, and for the input's
 * sums a vpmaddwd (Q6_K's - 32 sc, into the integers; Q4_K's mins, converted and by dmin). */
#define ROUND8_KERNEL(T, BYTES, MINS)                                                             \
    INLINE void T##_dot8_n(const int8_t *xq, const float *xs, const int16_t *bsum, int rows,     \
                           int k, const uint8_t *w, float *out, int n_out) {                      \
        vf acc[TILE];                                                                             \
        __m256 macc[TILE];                                                                        \
        int nb = k / 256;                                                                         \
        for (int i = 0; i < TILE; i++) {                                                          \
            acc[i] = vzero();                                                                     \
            macc[i] = _mm256_setzero_ps();                                                        \
        }                                                                                         \
        for (int b = 0; b < nb; b++) {                                                            \
            const uint8_t *blk = w + (size_t)b * (BYTES);                                         \
            block8 p;                                                                             \
            v8 codes[256 / STEP];                                                                 \
            vi isum[TILE];                                                                        \
            T##_prep8(blk, &p);                                                                   \
            T##_codes8(blk, codes);                                                               \
            SCALES_PREP;                                                                          \
            __m256i neg32 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(p.mul, 5)); \
            for (int i = 0; i < rows; i++) {                                                      \
                __m256i su = _mm256_loadu_si256(                                                  \
                    (const __m256i *)(bsum + (size_t)i * (k / 16) + (size_t)b * 16));             \
                if (MINS) { /* dmin x s x (mins . sums), subtracted at the end */                 \
                    __m256 dm = _mm256_set1_ps(p.dmin * xs[(size_t)i * nb + b]);                  \
                    macc[i] = _mm256_fmadd_ps(                                                    \
                        _mm256_cvtepi32_ps(_mm256_madd_epi16(p.mins, su)), dm, macc[i]);          \
                    isum[i] = izero();                                                            \
                } else { /* Q6_K's - 32 sc times the codes' sums */                               \
                    isum[i] = widen_sum(_mm256_madd_epi16(neg32, su));                            \
                }                                                                                 \
            }                                                                                     \
            _Pragma("GCC unroll 8")                                                               \
            for (int c = 0; c < 256 / STEP; c++) {                                                \
                SCALES_OF(c);                                                                     \
                const int8_t *xc = xq + (size_t)b * 256 + (size_t)c * STEP;                       \
                for (int i = 0; i < rows; i++)                                                    \
                    isum[i] = idot8(isum[i], codes[c], xc + (size_t)i * k, sc);                   \
            }                                                                                     \
            for (int i = 0; i < rows; i++)                                                        \
                acc[i] = vfma(vfloat(isum[i]), vset(p.d * xs[(size_t)i * nb + b]), acc[i]);      \
        }                                                                                         \
        for (int i = 0; i < rows; i++) {                                                          \
            __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(macc[i]),                               \
                                   _mm256_extractf128_ps(macc[i], 1));                            \
            m4 = _mm_add_ps(m4, _mm_movehl_ps(m4, m4));                                           \
            m4 = _mm_add_ss(m4, _mm_movehdup_ps(m4));                                             \
            out[(size_t)i * n_out] = vsum(acc[i]) - _mm_cvtss_f32(m4);                            \
        }                                                                                         \
    }                                                                                             \
    static void T##_dot8(const int8_t *xq, const float *xs, const int16_t *bsum, int rows, int k, \
                         const uint8_t *w, float *out, int n_out) {                               \
        switch (rows) {                                                                           \
        case 1: T##_dot8_n(xq, xs, bsum, 1, k, w, out, n_out); break;                             \
        case 2: T##_dot8_n(xq, xs, bsum, 2, k, w, out, n_out); break;                             \
        case 3: T##_dot8_n(xq, xs, bsum, 3, k, w, out, n_out); break;                             \
        default: T##_dot8_n(xq, xs, bsum, TILE, k, w, out, n_out);                                \
        }                                                                                         \
    }
#if VL == 16
#define SCALES_PREP                                                                               \
    __m512i halves[2] = {_mm512_broadcast_i32x4(_mm256_castsi256_si128(p.mul)),                   \
                         _mm512_broadcast_i32x4(_mm256_extracti128_si256(p.mul, 1))}
#define SCALES_OF(c) __m512i sc = scales64(halves, PICK, c)
#else
#define SCALES_PREP                                                                               \
    int16_t mul16[16];                                                                            \
    _mm256_storeu_si256((__m256i *)mul16, p.mul)
#define SCALES_OF(c) __m256i sc = scales32(mul16, c)
#endif
#define PICK Q4_K_PICK
ROUND8_KERNEL(q4_k, 144, 1)
#undef PICK
#define PICK Q6_K_PICK
ROUND8_KERNEL(q6_k, 210, 0)
#undef PICK
#undef SCALES_PREP
#undef SCALES_OF
#define DOT8(T) T##_dot8
#define ROUND8 round8
/* AVX-512's Q4_K kernel takes each 128 inputs as 0-31, 64-95, 32-63, 96-127: the low and high
 * nibbles of 64 bytes as they are */
#define Q4_K_ORDER(type) (VL == 16 && (type) == NBQ_GGML_Q4_K)
#else
#define DOT8(T) NULL
#define ROUND8(x, rows, k, per, q, s, bsum, swap, threads) ((void)0)  /* never reached: no DOT8 */
#define Q4_K_ORDER(type) 0
#endif
