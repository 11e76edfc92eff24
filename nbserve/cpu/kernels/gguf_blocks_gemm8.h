/* gguf_blocks.c's 8-bit products of many input rows (gemm8) for Q4_K and Q6_K, included once by
 * it after gguf_blocks_round8.h; built where the CPU has AVX-512 VNNI (vpdpbusd), NULL
 * elsewhere (BUILD8(T)), where batches keep the 8-bit row kernels.
 *
 * The row kernels (T_dot8) multiply one weight row with up to TILE input rows: per 64 weights
 * and input row a vpmaddubsw and a vpdpwssd, whose lanes hold 4 neighbouring products of the
 * same row, so the sub-block scales must be shuffled into every lane. Here 16 weight rows are
 * built once per chunk of input rows into one lane each: a 64-byte vector holds 4 neighbouring
 * codes of each of the 16 rows, and one vpdpbusd multiplies it with 4 inputs of one input row
 * broadcast from memory (64 products an instruction, no shuffle). A sub-block's (Q4_K: 32
 * weights, Q6_K: 16) integer sums then meet their scales (one per lane, vpmulld) in an int32
 * block sum, converted once a block and multiplied by d times the input's scale, as the row
 * kernels do; what the codes leave out (Q4_K's mins, Q6_K's - 32) goes through the input's sums
 * per 32 or 16 (vpdpwssd of int16 pairs). The product is the 8-bit input's with gguf's weights
 * up to float32 rounding, the same arithmetic as T_dot8 with the float sums in another order:
 * a row's product is the same bits in any batch of more than ROW_PATH_MAX rows, as it is in
 * any of up to ROW_PATH_MAX (the row kernels), and the two agree to float32 rounding. */
#if defined(HAS_ROUND8) && VL == 16 && defined(__AVX512VNNI__)
#define HAS_GEMM8 1
#define G8_LANES 16  /* weight rows a built block holds: one a 32-bit lane */
#define G8_C 8       /* input rows a tile: 3 x 8 vector accumulators */

/* One block (256 weights) of 16 weight rows built for gemm8: codes[64 t + 4 j + u] is row j's
 * weight 4 t + u (unsigned: Q4_K's 4 bits, Q6_K's 6 without the - 32); sc[g] each row's integer
 * scale of sub-block g; pairs[p] each row's two int16 factors of the input's sums p (Q4_K: the
 * mins m of sub-blocks 2p, 2p + 1, against the sums per 32; Q6_K: - 32 sc of 2p, 2p + 1, against
 * the sums per 16); d and dmin (Q4_K's factor of the mins) per row. Rows past the tensor's are
 * zero. */
typedef struct __attribute__((aligned(64))) built8 {
    uint8_t codes[64 * 64];
    int32_t sc[16][G8_LANES];
    int32_t pairs[8][G8_LANES];
    float d[G8_LANES], dmin[G8_LANES];
} built8;

/* A 16 x 16 int32 transpose: r[j] lane t -> r[t] lane j (4 stages of 16 shuffles) */
INLINE void transpose16(__m512i r[16]) {
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

/* a row's 256 codes in order, as 4 vectors of 64 */
INLINE void q4_k_codes_in_order(const uint8_t *blk, __m512i *out) {
    const uint8_t *qs = blk + 16;
    for (int c = 0; c < 4; c++) {  /* 32 bytes: weights 64 c + l (low), 64 c + 32 + l (high) */
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(15));
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
        out[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
}
INLINE void q6_k_codes_in_order(const uint8_t *blk, __m512i *out) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    for (int n = 0; n < 2; n++) {  /* 128 weights: ql[64 n..], qh[32 n..] */
        const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
        __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        __m256i q[4];
        for (int s = 0; s < 4; s++) {  /* weights 128 n + 32 s + l */
            __m256i low = _mm256_and_si256(_mm256_srli_epi16(s & 1 ? l1 : l0, 4 * (s >> 1)), m4);
            __m256i high = _mm256_and_si256(_mm256_srli_epi16(h, 2 * s), m2);
            q[s] = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
        }
        out[2 * n] = _mm512_inserti64x4(_mm512_castsi256_si512(q[0]), q[1], 1);
        out[2 * n + 1] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2]), q[3], 1);
    }
}

/* The codes of nw <= 16 rows (each `codes_of` 4 vectors a block, rows row_bytes apart) into
 * o->codes, one lane a row */
INLINE void lanes_of_rows(const uint8_t *w, size_t row_bytes, int nw, int q6, built8 *o) {
    __m512i rows[16][4];
    for (int j = 0; j < 16; j++) {
        if (j >= nw) {
            for (int c = 0; c < 4; c++) rows[j][c] = _mm512_setzero_si512();
        } else if (q6) {
            q6_k_codes_in_order(w + (size_t)j * row_bytes, rows[j]);
        } else {
            q4_k_codes_in_order(w + (size_t)j * row_bytes, rows[j]);
        }
    }
    for (int c = 0; c < 4; c++) {  /* quads 16 c .. 16 c + 15 */
        __m512i r[16];
        for (int j = 0; j < 16; j++) r[j] = rows[j][c];
        transpose16(r);
        for (int t = 0; t < 16; t++) _mm512_storeu_si512((void *)(o->codes + 64 * (16 * c + t)), r[t]);
    }
}

/* each row's 16 factor bytes (widened to int32 by `widen`) -> per factor, one lane a row */
INLINE void factors_of_rows(const __m128i bytes[16], int nw, int is_signed, __m512i r[16]) {
    for (int j = 0; j < 16; j++)
        r[j] = j >= nw ? _mm512_setzero_si512()
                       : is_signed ? _mm512_cvtepi8_epi32(bytes[j]) : _mm512_cvtepu8_epi32(bytes[j]);
    transpose16(r);
}

INLINE __m512i int16_pairs(__m512i lo, __m512i hi) {  /* (lo, hi) as int16 in each lane */
    return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(hi, 16));
}

static void q4_k_build8(const uint8_t *w, size_t row_bytes, int nw, built8 *o) {
    __m128i bytes[16];
    __m512i f[16];
    lanes_of_rows(w, row_bytes, nw, 0, o);
    for (int j = 0; j < 16; j++) {
        const uint8_t *blk = w + (size_t)(j < nw ? j : 0) * row_bytes;
        bytes[j] = q4_k_scales8(blk);  /* sc 0-7, m 0-7 */
        o->d[j] = j < nw ? half_at(blk) : 0.f;
        o->dmin[j] = j < nw ? half_at(blk + 2) : 0.f;
    }
    factors_of_rows(bytes, nw, 0, f);
    for (int g = 0; g < 8; g++) _mm512_store_si512((void *)o->sc[g], f[g]);
    for (int p = 0; p < 4; p++)
        _mm512_store_si512((void *)o->pairs[p], int16_pairs(f[8 + 2 * p], f[9 + 2 * p]));
}

static void q6_k_build8(const uint8_t *w, size_t row_bytes, int nw, built8 *o) {
    __m128i bytes[16];
    __m512i f[16];
    lanes_of_rows(w, row_bytes, nw, 1, o);
    for (int j = 0; j < 16; j++) {
        const uint8_t *blk = w + (size_t)(j < nw ? j : 0) * row_bytes;
        bytes[j] = _mm_loadu_si128((const __m128i *)(blk + 192));  /* int8 scales per 16 */
        o->d[j] = j < nw ? half_at(blk + 208) : 0.f;
        o->dmin[j] = 0.f;
    }
    factors_of_rows(bytes, nw, 1, f);
    for (int g = 0; g < 16; g++) _mm512_store_si512((void *)o->sc[g], f[g]);
    for (int p = 0; p < 8; p++) {
        __m512i a = _mm512_mullo_epi32(f[2 * p], _mm512_set1_epi32(-32));
        __m512i b = _mm512_mullo_epi32(f[2 * p + 1], _mm512_set1_epi32(-32));
        _mm512_store_si512((void *)o->pairs[p], int16_pairs(a, b));
    }
}

INLINE __m512i bcast4(const void *p) {  /* 4 bytes at p in every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* y[i n_out + j] (j < nw) = input row i (x: the 8-bit codes, rows k apart; xs its scales, rows
 * nb apart; su its int16 sums per `per` inputs, rows k / per apart) times the built rows (wb:
 * nb blocks) for NR input rows, the accumulators in registers over the whole row. GQ: quads a
 * sub-block (Q4_K 8, Q6_K 4); MINS: Q4_K's sums against the mins, times dmin (else Q6_K's, into
 * the integer sums). */
INLINE void tile8(const int8_t *restrict x, int k, const float *restrict xs,
                  const int16_t *restrict su, int per, const built8 *restrict wb, int nr, int gq,
                  int mins, float *y, int n_out, int nw) {
    __m512 acc[G8_C];
    int nb = k / 256, ng = 64 / gq, np = 256 / per / 2;
    for (int i = 0; i < nr; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const built8 *w = wb + b;
        const int8_t *xb = x + (size_t)b * 256;
        const int16_t *sb = su + (size_t)b * (256 / per);
        __m512i isum[G8_C], part[G8_C];
        for (int i = 0; i < nr; i++) isum[i] = _mm512_setzero_si512();
        for (int g = 0; g < ng; g++) {
            for (int i = 0; i < nr; i++) part[i] = _mm512_setzero_si512();
            for (int s = 0; s < gq; s++) {
                int t = g * gq + s;
                __m512i codes = _mm512_load_si512((const void *)(w->codes + 64 * t));
                for (int i = 0; i < nr; i++)
                    part[i] = _mm512_dpbusd_epi32(part[i], codes, bcast4(xb + (size_t)i * k + 4 * t));
            }
            __m512i sc = _mm512_load_si512((const void *)w->sc[g]);
            for (int i = 0; i < nr; i++) isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(part[i], sc));
        }
        __m512 d = _mm512_load_ps(w->d);
        if (mins) {
            for (int i = 0; i < nr; i++) {
                part[i] = _mm512_setzero_si512();
                for (int p = 0; p < np; p++)
                    part[i] = _mm512_dpwssd_epi32(part[i], _mm512_load_si512((const void *)w->pairs[p]),
                                                  bcast4(sb + (size_t)i * (k / per) + 2 * p));
            }
            __m512 dm = _mm512_load_ps(w->dmin);
            for (int i = 0; i < nr; i++) {
                __m512 s = _mm512_set1_ps(xs[(size_t)i * nb + b]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, s), acc[i]);
                acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(part[i]), _mm512_mul_ps(dm, s), acc[i]);
            }
        } else {
            for (int i = 0; i < nr; i++) {
                for (int p = 0; p < np; p++)
                    isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_load_si512((const void *)w->pairs[p]),
                                                  bcast4(sb + (size_t)i * (k / per) + 2 * p));
                __m512 s = _mm512_set1_ps(xs[(size_t)i * nb + b]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, s), acc[i]);
            }
        }
    }
    __mmask16 keep = (__mmask16)((1u << nw) - 1);
    for (int i = 0; i < nr; i++) _mm512_mask_storeu_ps(y + (size_t)i * n_out, keep, acc[i]);
}

#define TILE8_CASE(NR)                                                                           \
    case NR:                                                                                     \
        if (q6)                                                                                  \
            tile8(x, k, xs, su, 16, wb, NR, 4, 0, y, n_out, nw);                                 \
        else                                                                                     \
            tile8(x, k, xs, su, 32, wb, NR, 8, 1, y, n_out, nw);                                 \
        break;
static void tile8_any(const int8_t *x, int k, const float *xs, const int16_t *su,
                      const built8 *wb, int nr, int q6, float *y, int n_out, int nw) {
    switch (nr) {
        TILE8_CASE(1) TILE8_CASE(2) TILE8_CASE(3) TILE8_CASE(4)
        TILE8_CASE(5) TILE8_CASE(6) TILE8_CASE(7) TILE8_CASE(8)
    }
}

typedef void (*build8_fn)(const uint8_t *w, size_t row_bytes, int nw, built8 *o);

#define GEMM8_BYTES (256 << 10)  /* a chunk of input rows: 256 KiB of 8-bit codes, in L2 */
/* y (rows, n) = the 8-bit input (rows > ROW_PATH_MAX: batches, prompt chunks; x8 (rows, k) in
 * order, xs (rows, k / 256), su (rows, k / 32) for Q4_K, (rows, k / 16) for Q6_K) times n
 * weight rows of Q4_K (q6 0) or Q6_K (1), 16 weight rows built once a chunk of input rows, the
 * groups handed out one at a time. Returns 0, -1 when out of memory. */
static int blocks_gemm8(build8_fn build, int q6, int bytes, const int8_t *x8, const float *xs,
                        const int16_t *su, int rows, int k, const uint8_t *w, int n, float *y,
                        int threads) {
    int nb = k / 256, per = q6 ? 16 : 32;
    size_t row_bytes = (size_t)nb * bytes, each = sizeof(built8) * (size_t)nb;
    int chunk = (int)(GEMM8_BYTES / (size_t)k) / G8_C * G8_C;
    chunk = chunk < 4 * G8_C ? 4 * G8_C : chunk;
    char *built = aligned_alloc(64, each * (size_t)threads);
    if (!built) return -1;
    int groups = (n + G8_LANES - 1) / G8_LANES;
    #pragma omp parallel num_threads(threads)
    {
        built8 *wb = (built8 *)(built + each * (size_t)omp_get_thread_num());
        for (int c0 = 0; c0 < rows; c0 += chunk) {
            int cr = rows - c0 < chunk ? rows - c0 : chunk;
            #pragma omp for schedule(dynamic, 1)
            for (int g = 0; g < groups; g++) {
                int r = g * G8_LANES, nw = n - r < G8_LANES ? n - r : G8_LANES;
                for (int b = 0; b < nb; b++)
                    build(w + (size_t)r * row_bytes + (size_t)b * bytes, row_bytes, nw, &wb[b]);
                for (int i0 = 0; i0 < cr; i0 += G8_C) {
                    int i = c0 + i0;
                    tile8_any(x8 + (size_t)i * k, k, xs + (size_t)i * nb, su + (size_t)i * (k / per),
                              wb, cr - i0 < G8_C ? cr - i0 : G8_C, q6, y + (size_t)i * n + r, n, nw);
                }
            }
        }
    }
    free(built);
    return 0;
}
#define BUILD8(T) T##_build8
#else
#define BUILD8(T) NULL
#endif
