/* gguf_blocks.c's 8-bit products of many input rows (gemm8) for Q4_K and Q6_K, included once by
 * it after gguf_blocks_round8.h, on the builds that have those (AVX-512 with VNNI, AVX2); NULL
 * elsewhere (BUILD8(T)), where batches keep the 8-bit row kernels.
 *
 * The row kernels (T_dot8) multiply one weight row with up to TILE input rows: per 64 weights
 * and input row a vpmaddubsw and a vpdpwssd, whose lanes hold 4 neighbouring products of the
 * same row, so the sub-block scales must be shuffled into every lane. Here 16 weight rows are
 * built once per chunk of input rows into one lane each: a 64-byte vector holds 4 neighbouring
 * codes of each of the 16 rows, and one vpdpbusd multiplies it with 4 inputs of one input row
 * broadcast from memory (64 products an instruction, no shuffle). The input is rounded per 256
 * as the row kernels round it (decode batches: NBQ_ROUND8) or per 32 (prompt chunks:
 * NBQ_ROUND8_MANY; a scale a Q4_K sub-block, two of Q6_K's): a 256-wide rounding of prompts
 * moved half of Gemma 3 270M's greedy answers off exact arithmetic's, a 32-wide one a few
 * (benchmarks/README.md). A sub-block's (Q4_K: 32 weights, Q6_K: 16) integer sums meet their
 * scales (one per lane, vpmulld; Q4_K's per 32 on AVX-512 in float) in an int32 sum per block
 * or per 32 inputs, converted once and multiplied by the input's scale and d. The AVX2 build takes 8 weight rows a 256-bit vector: vpmaddubsw's pairs add up
 * in int16 over a sub-block (Q4_K: at most 8 x 2 x 15 x 127 = 30480) or half of one (Q6_K:
 * 2 x 2 x 63 x 127 = 32004), then one vpmaddwd by the scale (as an int16 pair) adds them to the
 * int32 sum. (An AVX-512 build without VNNI has no gemm8: its batches keep the row kernels.)
 * What the codes leave out: Q6_K's - 32 through the input codes' sums per 16 (vpdpwssd of int16
 * pairs) into the integer sums; Q4_K's mins (dmin m, float per lane) against the input's sums
 * per 32 times their scales, in float. The product is the one of gguf's weights with the
 * rounded input, up to float32 rounding; a row's product is the same bits in any batch of more
 * than ROW_PATH_MAX rows, as it is in any of up to ROW_PATH_MAX (the row kernels), and per 256
 * the two agree to float32 rounding. */
#if defined(HAS_ROUND8) && ((VL == 16 && defined(__AVX512VNNI__)) || VL == 8)
#define HAS_GEMM8 1
#if VL == 16
#define G8_LANES 16  /* weight rows a built block holds: one a 32-bit lane */
#define G8_C 8       /* input rows a tile: 3 x 8 vector accumulators */
typedef __m512i g8i;
typedef __m512 g8f;
#define G8_SUM16(q6) 64  /* steps summed before the scale: a whole sub-block, in int32 */
#else
#define G8_LANES 8
#define G8_C 4
typedef __m256i g8i;
typedef __m256 g8f;
#define G8_SUM16(q6) ((q6) ? 2 : 8)  /* steps of int16 pairs summed before the scale */
#endif

/* One block (256 weights) of G8_LANES weight rows built for gemm8: codes[4 L t + 4 j + u] (L =
 * G8_LANES) is row j's weight 4 t + u (unsigned: Q4_K's 4 bits, Q6_K's 6 without the - 32);
 * sc[g] each row's integer scale of sub-block g (AVX2: twice, as an int16 pair); pairs[p] each
 * row's two int16 factors of the input's sums p (Q4_K: the mins m of sub-blocks 2p, 2p + 1,
 * against the sums per 32, input rounded per 256; Q6_K: - 32 sc of 2p, 2p + 1, against the sums
 * per 16); Q4_K's dm[q] each row's dmin times the min of sub-block q (float), against the
 * input's scaled sums per 32 (input rounded per 32); d and dmin per row. Rows past the
 * tensor's are zero. */
typedef struct __attribute__((aligned(64))) built8 {
    uint8_t codes[64 * 4 * G8_LANES];
    int32_t sc[16][G8_LANES];
    int32_t pairs[8][G8_LANES];
    float dm[8][G8_LANES];
    float dsc[8][G8_LANES];  /* Q4_K on AVX-512: d sc of sub-block q, in float (no vpmulld) */
    float d[G8_LANES], dmin[G8_LANES];
} built8;
/* Q4_K's sub-block scales meet its sums in float (dsc) where the sums are int32 (AVX-512): one
 * vpmulld fewer per 32 inputs and input row; AVX2's vpmaddwd takes the scale for free */
#define G8_FLOAT_SCALES (G8_LANES == 16)

#if VL == 16
INLINE g8i g8_load(const void *p) { return _mm512_loadu_si512(p); }
INLINE g8i g8_zero(void) { return _mm512_setzero_si512(); }
INLINE g8i g8_set1(int32_t v) { return _mm512_set1_epi32(v); }
INLINE g8i g8_add32(g8i a, g8i b) { return _mm512_add_epi32(a, b); }
INLINE g8i g8_and(g8i a, g8i b) { return _mm512_and_si512(a, b); }
INLINE g8i g8_sll32(g8i a, int n) { return _mm512_slli_epi32(a, n); }
INLINE g8i g8_mul32(g8i a, g8i b) { return _mm512_mullo_epi32(a, b); }
INLINE void g8_store(void *p, g8i v) { _mm512_store_si512(p, v); }
/* part + codes . (the 4 bytes at x in every lane): 4 products a lane, the broadcast inside the
 * instruction ({1to16}, as gemm32's pairs_bcast: GCC loads it into a register first) */
INLINE g8i g8_product(g8i part, g8i codes, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(part) : "v"(codes), "m"(*(const int32_t *)x));
    return part;
}
/* isum + part by the sub-block's scales */
INLINE g8i g8_close(g8i isum, g8i part, g8i sc) { return _mm512_add_epi32(isum, _mm512_mullo_epi32(part, sc)); }
INLINE g8i g8_pairs(g8i acc, g8i a, g8i b) { return _mm512_dpwssd_epi32(acc, a, b); }
INLINE g8f g8_float(g8i v) { return _mm512_cvtepi32_ps(v); }
INLINE g8f g8_fzero(void) { return _mm512_setzero_ps(); }
INLINE g8f g8_fload(const float *p) { return _mm512_load_ps(p); }
INLINE g8f g8_fset1(float v) { return _mm512_set1_ps(v); }
INLINE g8f g8_fmul(g8f a, g8f b) { return _mm512_mul_ps(a, b); }
INLINE g8f g8_fmadd(g8f a, g8f b, g8f c) { return _mm512_fmadd_ps(a, b, c); }
INLINE g8f g8_fnmadd(g8f a, g8f b, g8f c) { return _mm512_fnmadd_ps(a, b, c); }
INLINE void g8_fstore(float *y, g8f v, int nw) { _mm512_mask_storeu_ps(y, (__mmask16)((1u << nw) - 1), v); }
INLINE g8i g8_widen(__m128i v, int is_signed) {  /* 16 bytes to int32 */
    return is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

/* A 16 x 16 int32 transpose: r[j] lane t -> r[t] lane j (4 stages of 16 shuffles) */
INLINE void g8_transpose(g8i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {  /* 128-bit lane L: rows i, i + 1 at 4L, 4L+1 | 4L+2, 4L+3 */
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* b[i + c] lane L: rows i .. i + 3 at column 4L + c */
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        /* lanes: rows 0-3 and 4-7 (8-11 and 12-15) at columns c, 8 + c (lo) or 4 + c, 12 + c (hi) */
        __m512i lo = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
        __m512i hi = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
        __m512i lo2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
        __m512i hi2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
        r[c] = _mm512_shuffle_i32x4(lo, lo2, _MM_SHUFFLE(2, 0, 2, 0));
        r[8 + c] = _mm512_shuffle_i32x4(lo, lo2, _MM_SHUFFLE(3, 1, 3, 1));
        r[4 + c] = _mm512_shuffle_i32x4(hi, hi2, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + c] = _mm512_shuffle_i32x4(hi, hi2, _MM_SHUFFLE(3, 1, 3, 1));
    }
}
#else
INLINE g8i g8_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE g8i g8_zero(void) { return _mm256_setzero_si256(); }
INLINE g8i g8_set1(int32_t v) { return _mm256_set1_epi32(v); }
INLINE g8i g8_add32(g8i a, g8i b) { return _mm256_add_epi32(a, b); }
INLINE g8i g8_and(g8i a, g8i b) { return _mm256_and_si256(a, b); }
INLINE g8i g8_sll32(g8i a, int n) { return _mm256_slli_epi32(a, n); }
INLINE g8i g8_mul32(g8i a, g8i b) { return _mm256_mullo_epi32(a, b); }
INLINE void g8_store(void *p, g8i v) { _mm256_store_si256((__m256i *)p, v); }
/* part + codes . (the 4 bytes at x in every lane) as int16 pairs (vpmaddubsw: 2 products a
 * pair, never saturating here) */
INLINE g8i g8_product(g8i part, g8i codes, const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_add_epi16(part, _mm256_maddubs_epi16(codes, _mm256_set1_epi32(v)));
}
/* isum + the pairs by the sub-block's scale (an int16 pair a lane) */
INLINE g8i g8_close(g8i isum, g8i part, g8i sc) { return _mm256_add_epi32(isum, _mm256_madd_epi16(part, sc)); }
INLINE g8i g8_pairs(g8i acc, g8i a, g8i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
INLINE g8f g8_float(g8i v) { return _mm256_cvtepi32_ps(v); }
INLINE g8f g8_fzero(void) { return _mm256_setzero_ps(); }
INLINE g8f g8_fload(const float *p) { return _mm256_load_ps(p); }
INLINE g8f g8_fset1(float v) { return _mm256_set1_ps(v); }
INLINE g8f g8_fmul(g8f a, g8f b) { return _mm256_mul_ps(a, b); }
INLINE g8f g8_fmadd(g8f a, g8f b, g8f c) { return _mm256_fmadd_ps(a, b, c); }
INLINE g8f g8_fnmadd(g8f a, g8f b, g8f c) { return _mm256_fnmadd_ps(a, b, c); }
INLINE void g8_fstore(float *y, g8f v, int nw) {
    __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nw), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(y, keep, v);
}
INLINE g8i g8_widen(__m128i v, int is_signed) {  /* the first 8 bytes to int32 */
    return is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

/* An 8 x 8 int32 transpose: r[j] lane t -> r[t] lane j */
INLINE void g8_transpose(g8i r[8]) {
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {  /* b[i + c] 128-bit lane L: rows i .. i + 3 at 4L + c */
        b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x20);
        r[4 + c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x31);
    }
}
#endif

INLINE g8i g8_bcast4(const void *p) {  /* 4 bytes at p in every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return g8_set1(v);
}

/* a row's 256 codes in order, into out[256] */
INLINE void q4_k_codes_in_order(const uint8_t *blk, uint8_t *out) {
    const uint8_t *qs = blk + 16;
    for (int c = 0; c < 4; c++) {  /* 32 bytes: weights 64 c + l (low), 64 c + 32 + l (high) */
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        _mm256_storeu_si256((__m256i *)(out + 64 * c), _mm256_and_si256(v, _mm256_set1_epi8(15)));
        _mm256_storeu_si256((__m256i *)(out + 64 * c + 32),
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)));
    }
}
INLINE void q6_k_codes_in_order(const uint8_t *blk, uint8_t *out) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    for (int n = 0; n < 2; n++) {  /* 128 weights: ql[64 n..], qh[32 n..] */
        const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
        __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        for (int s = 0; s < 4; s++) {  /* weights 128 n + 32 s + l */
            __m256i low = _mm256_and_si256(_mm256_srli_epi16(s & 1 ? l1 : l0, 4 * (s >> 1)), m4);
            __m256i high = _mm256_and_si256(_mm256_srli_epi16(h, 2 * s), m2);
            _mm256_storeu_si256((__m256i *)(out + 128 * n + 32 * s),
                                _mm256_or_si256(low, _mm256_slli_epi16(high, 4)));
        }
    }
}

/* The codes of nw <= G8_LANES rows (rows row_bytes apart) into o->codes, one lane a row */
INLINE void lanes_of_rows(const uint8_t *w, size_t row_bytes, int nw, int q6, built8 *o) {
    uint8_t rows[G8_LANES][256] __attribute__((aligned(64)));
    for (int j = 0; j < G8_LANES; j++) {
        if (j >= nw)
            memset(rows[j], 0, 256);
        else if (q6)
            q6_k_codes_in_order(w + (size_t)j * row_bytes, rows[j]);
        else
            q4_k_codes_in_order(w + (size_t)j * row_bytes, rows[j]);
    }
    for (int c = 0; c < 64 / G8_LANES; c++) {  /* quads G8_LANES c .. */
        g8i r[G8_LANES];
        for (int j = 0; j < G8_LANES; j++) r[j] = g8_load(rows[j] + 4 * G8_LANES * c);
        g8_transpose(r);
        for (int t = 0; t < G8_LANES; t++)
            g8_store(o->codes + 4 * G8_LANES * (G8_LANES * c + t), r[t]);
    }
}

/* each row's 16 factor bytes -> per factor f[0..15], one int32 lane a row */
INLINE void factors_of_rows(const __m128i bytes[G8_LANES], int nw, int is_signed, g8i f[16]) {
    for (int h = 0; h < 16 / G8_LANES; h++) {  /* AVX2: bytes 0-7, then 8-15 */
        g8i r[G8_LANES];
        for (int j = 0; j < G8_LANES; j++)
            r[j] = j >= nw ? g8_zero() : g8_widen(h ? _mm_srli_si128(bytes[j], 8) : bytes[j], is_signed);
        g8_transpose(r);
        for (int g = 0; g < G8_LANES; g++) f[G8_LANES * h + g] = r[g];
    }
}

INLINE g8i int16_pairs(g8i lo, g8i hi) {  /* (lo, hi) as int16 in each lane */
    return g8_add32(g8_and(lo, g8_set1(0xffff)), g8_sll32(hi, 16));
}
INLINE g8i scale_of(g8i sc) {  /* what g8_close takes: AVX-512 the int32, AVX2 an int16 pair */
    return G8_LANES == 16 ? sc : int16_pairs(sc, sc);
}

static void q4_k_build8(const uint8_t *w, size_t row_bytes, int nw, void *out) {
    built8 *o = out;
    __m128i bytes[G8_LANES];
    g8i f[16];
    lanes_of_rows(w, row_bytes, nw, 0, o);
    for (int j = 0; j < G8_LANES; j++) {
        const uint8_t *blk = w + (size_t)(j < nw ? j : 0) * row_bytes;
        bytes[j] = q4_k_scales8(blk);  /* sc 0-7, m 0-7 */
        o->d[j] = j < nw ? half_at(blk) : 0.f;
        o->dmin[j] = j < nw ? half_at(blk + 2) : 0.f;
    }
    factors_of_rows(bytes, nw, 0, f);
    for (int g = 0; g < 8; g++) g8_store(o->sc[g], scale_of(f[g]));
    for (int p = 0; p < 4; p++) g8_store(o->pairs[p], int16_pairs(f[8 + 2 * p], f[9 + 2 * p]));
    for (int q = 0; q < 8; q++) {
        g8_fstore(o->dm[q], g8_fmul(g8_float(f[8 + q]), g8_fload(o->dmin)), G8_LANES);
        if (G8_FLOAT_SCALES)  /* its only reader: tile8's float_sc */
            g8_fstore(o->dsc[q], g8_fmul(g8_float(f[q]), g8_fload(o->d)), G8_LANES);
    }
}

static void q6_k_build8(const uint8_t *w, size_t row_bytes, int nw, void *out) {
    built8 *o = out;
    __m128i bytes[G8_LANES];
    g8i f[16];
    lanes_of_rows(w, row_bytes, nw, 1, o);
    for (int j = 0; j < G8_LANES; j++) {
        const uint8_t *blk = w + (size_t)(j < nw ? j : 0) * row_bytes;
        bytes[j] = _mm_loadu_si128((const __m128i *)(blk + 192));  /* int8 scales per 16 */
        o->d[j] = j < nw ? half_at(blk + 208) : 0.f;
        o->dmin[j] = 0.f;
    }
    factors_of_rows(bytes, nw, 1, f);
    for (int g = 0; g < 16; g++) g8_store(o->sc[g], scale_of(f[g]));
    for (int q = 0; q < 8; q++)
        g8_store(o->pairs[q], int16_pairs(g8_mul32(f[2 * q], g8_set1(-32)),
                                          g8_mul32(f[2 * q + 1], g8_set1(-32))));
}

/* y[i n_out + j] (j < nw) = input row i (x: the 8-bit codes, rows k apart; xs its scales, per
 * 256 (`wide`) or per 32, rows k / 256 or k / 32 apart; su its int16 sums, Q6_K's per 16 (rows
 * k / 16 apart), Q4_K's per 32 when wide (rows k / 32 apart); else Q4_K's fs, its sums per 32
 * times their scales, rows k / 32 apart) times the built
 * rows (wb: k / 256 blocks) for nr input rows, the accumulators in registers over the whole row.
 * The integer products meet their sub-block scales (run steps summed before the scale), Q6_K's
 * - 32 sc the input's sums; then one conversion per 32 inputs (a Q4_K sub-block, two of
 * Q6_K's), times the input's scale and d (Q4_K on AVX-512: d sc), or per block (`wide`: one
 * scale a block, the integers summed over it). Q4_K's mins meet the sums in integers when
 * wide, the scaled sums in float otherwise. */
INLINE void tile8(const int8_t *restrict x, int k, const float *restrict xs,
                  const int16_t *restrict su, const float *restrict fs,
                  const built8 *restrict wb, int nr, int q6, int wide, int run, float *y,
                  int n_out, int nw) {
    g8f acc[G8_C];
    g8i isum[G8_C], part[G8_C];
    int nb = k / 256, subs = q6 ? 2 : 1, gq = q6 ? 4 : 8;  /* sub-blocks and their quads a 32 */
    int per_row = wide ? nb : k / 32, float_sc = !q6 && !wide && G8_FLOAT_SCALES;
    run = run < gq ? run : gq;
    for (int i = 0; i < nr; i++) acc[i] = g8_fzero();
    for (int b = 0; b < nb; b++) {
        const built8 *w = wb + b;
        const int8_t *xb = x + (size_t)b * 256;
        g8f d = g8_fload(w->d);
        for (int i = 0; i < nr; i++) isum[i] = g8_zero();
        for (int q = 0; q < 8; q++) {
            for (int g = subs * q; g < subs * (q + 1); g++) {
                g8i sc = g8_load(w->sc[g]);
                for (int h = 0; h < gq; h += run) {
                    for (int i = 0; i < nr; i++) part[i] = g8_zero();
                    for (int s = 0; s < run; s++) {
                        int t = g * gq + h + s;
                        g8i codes = g8_load(w->codes + 4 * G8_LANES * t);
                        for (int i = 0; i < nr; i++)
                            part[i] = g8_product(part[i], codes, xb + (size_t)i * k + 4 * t);
                    }
                    if (float_sc)  /* one sub-block, in one run: its scale in float below */
                        for (int i = 0; i < nr; i++) isum[i] = part[i];
                    else
                        for (int i = 0; i < nr; i++) isum[i] = g8_close(isum[i], part[i], sc);
                }
            }
            size_t at = (size_t)b * 8 + q;  /* this 32's place in a row's sums */
            if (q6) {
                g8i pairs = g8_load(w->pairs[q]);
                for (int i = 0; i < nr; i++)
                    isum[i] = g8_pairs(isum[i], pairs,
                                       g8_bcast4(su + (size_t)i * (k / 16) + 2 * at));
            }
            if (!wide) {
                g8f by = float_sc ? g8_fload(w->dsc[q]) : d;
                for (int i = 0; i < nr; i++) {
                    g8f s = g8_fset1(xs[(size_t)i * per_row + at]);
                    acc[i] = g8_fmadd(g8_fmul(g8_float(isum[i]), s), by, acc[i]);
                    isum[i] = g8_zero();
                }
            }
            if (!q6 && !wide) {
                g8f dm = g8_fload(w->dm[q]);
                for (int i = 0; i < nr; i++)
                    acc[i] = g8_fnmadd(dm, g8_fset1(fs[(size_t)i * (k / 32) + at]), acc[i]);
            }
        }
        if (wide && !q6) {  /* the mins m against the sums per 32 (su), in integers */
            g8f dmin = g8_fload(w->dmin);
            for (int i = 0; i < nr; i++) {
                g8i mins = g8_zero();
                for (int p = 0; p < 4; p++)
                    mins = g8_pairs(mins, g8_load(w->pairs[p]),
                                    g8_bcast4(su + (size_t)i * (k / 32) + (size_t)b * 8 + 2 * p));
                acc[i] = g8_fnmadd(g8_float(mins),
                                   g8_fmul(dmin, g8_fset1(xs[(size_t)i * per_row + b])), acc[i]);
            }
        }
        if (wide)
            for (int i = 0; i < nr; i++)
                acc[i] = g8_fmadd(g8_float(isum[i]), g8_fmul(d, g8_fset1(xs[(size_t)i * per_row + b])),
                                  acc[i]);
    }
    for (int i = 0; i < nr; i++) g8_fstore(y + (size_t)i * n_out, acc[i], nw);
}

#define TILE8_CASE(NR)                                                                           \
    case NR:                                                                                     \
        if (q6 && wide)                                                                          \
            tile8(x, k, xs, su, fs, wb, NR, 1, 1, G8_SUM16(1), y, n_out, nw);                    \
        else if (q6)                                                                             \
            tile8(x, k, xs, su, fs, wb, NR, 1, 0, G8_SUM16(1), y, n_out, nw);                    \
        else if (wide)                                                                           \
            tile8(x, k, xs, su, fs, wb, NR, 0, 1, G8_SUM16(0), y, n_out, nw);                    \
        else                                                                                     \
            tile8(x, k, xs, su, fs, wb, NR, 0, 0, G8_SUM16(0), y, n_out, nw);                    \
        break;
static void tile8_any(const int8_t *x, int k, const float *xs, const int16_t *su,
                      const float *fs, const built8 *wb, int nr, int q6, int wide, float *y,
                      int n_out, int nw) {
    switch (nr) {
        TILE8_CASE(1) TILE8_CASE(2) TILE8_CASE(3) TILE8_CASE(4)
#if G8_C == 8
        TILE8_CASE(5) TILE8_CASE(6) TILE8_CASE(7) TILE8_CASE(8)
#endif
    }
}

/* ---------------------------------------------------------------- the lanes driver */

/* One product over weight rows built G8_LANES at a time (gemm8's, gemm32's): n weight rows of
 * nb blocks of `bytes` (row_bytes apart), each block of a group built by `build` into
 * built_bytes; `tile` multiplies nr input rows from row i with a group's nb built blocks into
 * y (the group's first output of row i, rows n apart); `input` is what tile reads. */
typedef struct lanes_job {
    const uint8_t *w;
    size_t row_bytes, built_bytes;
    int bytes, nb, n, k, chunk;
    void (*build)(const uint8_t *w, size_t row_bytes, int nw, void *o);
    void (*tile)(const struct lanes_job *job, int i, int nr, const char *built, float *y, int nw);
    const void *input;
} lanes_job;

/* y (rows, n) = the input's rows times the weight rows, a group of G8_LANES built once per
 * chunk of job->chunk input rows (kept in L2 while every group meets them), the groups handed
 * out one at a time so that a core slowed by a neighbour does not hold the other at the
 * barrier. Returns 0, -1 when out of memory. */
static int lanes_gemm(const lanes_job *job, int rows, float *y, int threads) {
    size_t each = job->built_bytes * (size_t)job->nb;
    char *built = aligned_alloc(64, each * (size_t)threads);
    if (!built) return -1;
    int n = job->n, groups = (n + G8_LANES - 1) / G8_LANES;
    #pragma omp parallel num_threads(threads)
    {
        char *wb = built + each * (size_t)omp_get_thread_num();
        for (int c0 = 0; c0 < rows; c0 += job->chunk) {
            int c1 = rows - c0 < job->chunk ? rows : c0 + job->chunk;
            #pragma omp for schedule(dynamic, 1)
            for (int g = 0; g < groups; g++) {
                int r = g * G8_LANES, nw = n - r < G8_LANES ? n - r : G8_LANES;
                for (int b = 0; b < job->nb; b++)
                    job->build(job->w + (size_t)r * job->row_bytes + (size_t)b * job->bytes,
                               job->row_bytes, nw, wb + job->built_bytes * (size_t)b);
                for (int i = c0; i < c1; i += G8_C)
                    job->tile(job, i, c1 - i < G8_C ? c1 - i : G8_C, wb, y + (size_t)i * n + r, nw);
            }
        }
    }
    free(built);
    return 0;
}

#define LANES_CHUNK_BYTES (256 << 10)  /* a chunk of input rows' codes: 256 KiB, in L2 */
/* input rows a chunk (k `width`-byte codes a row), whole tiles */
INLINE int lanes_chunk(int k, int width) {
    int chunk = (int)(LANES_CHUNK_BYTES / ((size_t)width * (size_t)k)) / G8_C * G8_C;
    return chunk < 4 * G8_C ? 4 * G8_C : chunk;
}

typedef struct {  /* gemm8's input: round8's codes in order, scales per 256 (wide) or per 32,
                     Q6_K's sums per 16 or Q4_K's scaled sums per 32 */
    const int8_t *x;
    const float *xs;
    const int16_t *su;
    const float *fs;
    int q6, wide;
} input8;

static void tile8_job(const lanes_job *job, int i, int nr, const char *built, float *y, int nw) {
    const input8 *in = job->input;
    int k = job->k;
    tile8_any(in->x + (size_t)i * k, k, in->xs + (size_t)i * (k / (in->wide ? 256 : 32)),
              in->su ? in->su + (size_t)i * (k / (in->q6 ? 16 : 32)) : NULL,
              in->fs ? in->fs + (size_t)i * (k / 32) : NULL, (const built8 *)built, nr, in->q6,
              in->wide, y, job->n, nw);
}

/* y (rows, n) = the 8-bit input (rows > ROW_PATH_MAX: batches, prompt chunks; x8 (rows, k) in
 * order, xs (rows, k / per), per 256 or 32; Q6_K (q6 1): su (rows, k / 16) the codes' sums per
 * 16; Q4_K (q6 0): su (rows, k / 32) the sums per 32 (per 256), or fs (rows, k / 32) the sums
 * per 32 times their scales (per 32)) times n weight rows of Q4_K or Q6_K (`build` a block,
 * `bytes` a block). Returns 0, -1 when out of memory. */
static int blocks_gemm8(void (*build)(const uint8_t *, size_t, int, void *), int q6, int bytes,
                        const int8_t *x8, const float *xs, int per, const int16_t *su,
                        const float *fs, int rows, int k, const uint8_t *w, int n, float *y,
                        int threads) {
    input8 in = {x8, xs, su, fs, q6, per == 256};
    lanes_job job = {w, (size_t)(k / 256) * bytes, sizeof(built8), bytes, k / 256, n, k,
                     lanes_chunk(k, 1), build, tile8_job, &in};
    return lanes_gemm(&job, rows, y, threads);
}
#define BUILD8(T) T##_build8
#else
#define BUILD8(T) NULL
#endif
