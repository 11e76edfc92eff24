/* gguf_blocks.c's rounded-input row kernels (NBQ_ROUND16), included once by it (apart for
 * length): per type, a block's codes times the input's 16-bit codes in integers; DOT16(T)
 * names a type's kernel, NULL on a build without them. */
#if defined(HAS_DIRECT_DOTS) && (VL == 8 || defined(__AVX512BW__))
#include <omp.h>
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
/* *a += add (16 floats) times su (16 floats), lane-wise (AVX2: both halves into the one) */
INLINE void add16_into(const float *add, const float *su, vf *a) {
    for (int h = 0; h < 16 / VL; h++) *a = vfma(vload(add + h * VL), vload(su + h * VL), *a);
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

/* The 256-weight types' integer sums (below): zero, and the conversion every FLUSH_EVERY
 * chunks of 32 that keeps a lane's sum below 2^31 */
#if VL == 16
INLINE vi izero(void) { return _mm512_setzero_si512(); }
#define FLUSH_EVERY 8
#else
INLINE vi izero(void) { return _mm256_setzero_si256(); }
#define FLUSH_EVERY 4
#endif
#if VL == 16
typedef __m512i x16;  /* 32 of the input's 16-bit codes */
INLINE x16 xload16(const int16_t *x) { return _mm512_loadu_si512((const void *)x); }
INLINE vi iacc_x(vi acc, w16 w, x16 x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
INLINE w16 mul16_c(w16 w, const int16_t *mul, int c, int mul32) {
    if (mul32) return _mm512_mullo_epi16(w, _mm512_set1_epi16(mul[2 * c]));
    return _mm512_mullo_epi16(w, _mm512_inserti64x4(_mm512_set1_epi16(mul[2 * c]),
                                                    _mm256_set1_epi16(mul[2 * c + 1]), 1));
}
#define PIN(v) __asm__("" : "+v"(v))  /* v in a register here */
#define G_NR 4  /* block products: input rows a tile (32 vector registers) */
#define G_NW 3  /* weight rows a call */
#else
typedef struct { __m256i lo, hi; } x16;
INLINE x16 xload16(const int16_t *x) {
    x16 r = {_mm256_loadu_si256((const __m256i *)x), _mm256_loadu_si256((const __m256i *)(x + 16))};
    return r;
}
INLINE vi iacc_x(vi acc, w16 w, x16 x) {
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(w.lo, x.lo),
                                                  _mm256_madd_epi16(w.hi, x.hi)));
}
INLINE w16 mul16_c(w16 w, const int16_t *mul, int c, int mul32) {
    (void)mul32;
    return mul16(w, mul, c);
}
#define PIN(v) do { __asm__("" : "+x"((v).lo)); __asm__("" : "+x"((v).hi)); } while (0)
#define G_NR 2  /* 16 vector registers */
#define G_NW 2
#endif

/* A block of weights built for the integer products once, for every input row: its 8 chunks
 * of 32 as int16 (codes times their integer factor), d, and the adds per 16 (0 without). */
typedef struct built16 {
    w16 c[8];
    float d, add[16];
} built16;
typedef void (*build16_fn)(const uint8_t *blk, built16 *o);

/* One block's products of nr input rows (x: the first at the block, rows k apart; xs, su: its
 * scale and sums per 16 at the block, rows nb and k / 16 apart) with nw built weight blocks
 * (wb), into the float accumulators acc[i][r]: the adds first, then the integer sums
 * converted every FLUSH_EVERY chunks, times d and the input's scale: T_dot16's operations in
 * the same order (there with the weights built in registers), so a row's product is the same
 * bits whichever kernel takes it. */
INLINE void block16_step(const int16_t *restrict x, int k, const float *restrict xs, int nb,
                         const float *restrict su, const built16 *restrict wb, int nr, int nw,
                         int add, vf acc[][G_NW]) {
    vi isum[G_NR][G_NW];
    for (int i = 0; i < nr; i++)
        for (int r = 0; r < nw; r++) {
            isum[i][r] = izero();
            if (add) add16_into(wb[r].add, su + (size_t)i * (k / 16), &acc[i][r]);
        }
    _Pragma("GCC unroll 8")
    for (int c = 0; c < 8; c++) {
        w16 wc[G_NW];  /* in registers for the tile's rows (pinned: GCC otherwise reloads
                          them for every product and reads the input from memory) */
        x16 xv[G_NR];
        for (int r = 0; r < nw; r++) {
            wc[r] = wb[r].c[c];
            PIN(wc[r]);
        }
        for (int i = 0; i < nr; i++) {
            xv[i] = xload16(x + (size_t)i * k + c * 32);
            PIN(xv[i]);
        }
        for (int i = 0; i < nr; i++)
            for (int r = 0; r < nw; r++) isum[i][r] = iacc_x(isum[i][r], wc[r], xv[i]);
        if (c % FLUSH_EVERY == FLUSH_EVERY - 1)
            for (int i = 0; i < nr; i++)
                for (int r = 0; r < nw; r++) {
                    vf f = vset(wb[r].d * xs[(size_t)i * nb]);
                    acc[i][r] = vfma(vfloat(isum[i][r]), f, acc[i][r]);
                    isum[i][r] = izero();
                }
    }
}

/* A tile of nr input rows (x, xs, su at the row's start) times nw weight rows built block by
 * block (wb: G_NW built blocks a block), to y[i * n_out + r], the accumulators in registers
 * over the whole row. */
INLINE void tile16(const int16_t *restrict x, int k, const float *restrict xs,
                   const float *restrict su, const built16 *restrict wb, int nr, int nw, int add,
                   float *y, int n_out) {
    vf acc[G_NR][G_NW];
    int nb = k / 256;
    for (int i = 0; i < nr; i++)
        for (int r = 0; r < nw; r++) acc[i][r] = vzero();
    for (int b = 0; b < nb; b++)
        block16_step(x + (size_t)b * 256, k, xs + b, nb, su + (size_t)b * 16, wb + b * G_NW, nr,
                     nw, add, acc);
    for (int i = 0; i < nr; i++)
        for (int r = 0; r < nw; r++) y[(size_t)i * n_out + r] = vsum(acc[i][r]);
}

#define TILE16_CASE(NR, NW)                                                                      \
    case (NR) * 8 + (NW): tile16(x, k, xs, su, wb, NR, NW, add, y, n_out); break;
#if G_NR == 4
#define TILE16_W(NW) TILE16_CASE(1, NW) TILE16_CASE(2, NW) TILE16_CASE(3, NW) TILE16_CASE(4, NW)
#else
#define TILE16_W(NW) TILE16_CASE(1, NW) TILE16_CASE(2, NW)
#endif
#if G_NW == 4
#define TILE16_ALL TILE16_W(1) TILE16_W(2) TILE16_W(3) TILE16_W(4)
#elif G_NW == 3
#define TILE16_ALL TILE16_W(1) TILE16_W(2) TILE16_W(3)
#else
#define TILE16_ALL TILE16_W(1) TILE16_W(2)
#endif
static void tile16_any(const int16_t *x, int k, const float *xs, const float *su,
                       const built16 *wb, int nr, int nw, int add, float *y, int n_out) {
    switch (nr * 8 + nw) { TILE16_ALL }
}

/* y (rows, nw of n_out) = the 16-bit input's rows (xq (rows, k), xs (rows, k / 256), xsum
 * (rows, k / 16)) times nw <= G_NW weight rows (w, row_bytes apart) of a 256-weight type:
 * the weight rows' blocks are built once into wb (k / 256 * G_NW of them) for all the input
 * rows (the row kernels build a block once per TILE rows), then each tile of G_NR input rows
 * meets them, each input chunk loaded once for the nw weight rows. */
static void gemm16(build16_fn build, int bytes, int add, const int16_t *xq, const float *xs,
                   const float *xsum, int rows, int k, const uint8_t *w, size_t row_bytes, int nw,
                   float *y, int n_out, built16 *wb) {
    int nb = k / 256;
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < nw; r++)
            build(w + (size_t)r * row_bytes + (size_t)b * bytes, &wb[b * G_NW + r]);
    for (int i0 = 0; i0 < rows; i0 += G_NR)
        tile16_any(xq + (size_t)i0 * k, k, xs + (size_t)i0 * nb, xsum + (size_t)i0 * (k / 16), wb,
                   rows - i0 < G_NR ? rows - i0 : G_NR, nw, add, y + (size_t)i0 * n_out, n_out);
}

#define GEMM16_BYTES (256 << 10)  /* a chunk of input rows: 256 KiB of 16-bit codes, in L2 */
#define GEMM16_UNITS 4            /* groups of G_NW weight rows a thread takes at a time */
/* y (rows, n) = the 16-bit input (rows > ROW_PATH_MAX: prompt chunks, batches) times n weight
 * rows of a 256-weight type, G_NW weight rows at a time (gemm16) over chunks of input rows
 * that stay in L2, each group of weight rows built once a chunk; the groups handed out a few
 * at a time, so that a core slowed by a neighbour does not hold the other at the barrier
 * (the VMs measured have such cores). The same bits as T_dot16 for every row. Returns 0, -1
 * when out of memory. */
static int blocks_gemm16(build16_fn build, int add, int bytes, const int16_t *xq,
                         const float *xs, const float *xsum, int rows, int k, const uint8_t *w,
                         int n, float *y, int threads) {
    size_t row_bytes = (size_t)(k / 256) * bytes, each = sizeof(built16) * G_NW * (k / 256);
    int chunk = (int)(GEMM16_BYTES / (2 * (size_t)k)) / G_NR * G_NR;
    chunk = chunk < 8 * G_NR ? 8 * G_NR : chunk;
    char *built = aligned_alloc(64, each * (size_t)threads);
    if (!built) return -1;
    int groups = (n + G_NW - 1) / G_NW;
    #pragma omp parallel num_threads(threads)
    {
        built16 *wb = (built16 *)(built + each * (size_t)omp_get_thread_num());
        for (int c0 = 0; c0 < rows; c0 += chunk) {
            int cr = rows - c0 < chunk ? rows - c0 : chunk;
            #pragma omp for schedule(dynamic, GEMM16_UNITS)
            for (int g = 0; g < groups; g++) {
                int r = g * G_NW;
                gemm16(build, bytes, add, xq + (size_t)c0 * k, xs + (size_t)c0 * (k / 256),
                       xsum + (size_t)c0 * (k / 16), cr, k, w + (size_t)r * row_bytes, row_bytes,
                       n - r < G_NW ? n - r : G_NW, y + (size_t)c0 * n + r, n, wb);
            }
        }
    }
    free(built);
    return 0;
}

/* T_dot16: the 256-weight types (the K-quants, IQ4_XS) over up to TILE rows of one weight row,
 * the input rounded per 256 (one scale a block, as llama.cpp's Q8_K) and every weight
 * d * (mul * code) + add with an integer mul per 16 weights (a sub-block's scale; MUL32: one
 * per 32, Q4_K's, Q5_K's, IQ4_XS's, broadcast at once), so that a block's products add up in
 * int32 (|mul code| <= 4096: on AVX-512 a lane sums 16 products, below 2^31; on AVX2 32, so
 * there the sums are converted every 4 chunks) before one conversion and FMA by d times the
 * input's scale; vpdpwssd where the CPU has AVX-512 VNNI. The adds meet the rounded input's
 * sums per 16 in the accumulators (whose lanes are summed at the end). T_build16 builds a
 * block for gemm16. */
#define ROUNDED256(T, BYTES, ADD, MUL32)                                                         \
    __attribute__((unused)) static void T##_build16(const uint8_t *blk, built16 *o) {            \
        block16 p;                                                                               \
        T##_prep(blk, &p);                                                                       \
        for (int c = 0; c < 8; c++) o->c[c] = mul16_c(widen(T##_chunk(blk, c)), p.mul, c, MUL32); \
        o->d = p.scale[0];                                                                       \
        if (ADD) memcpy(o->add, p.add, sizeof o->add);                                           \
    }                                                                                            \
    INLINE void T##_dot16_n(const int16_t *xq, const float *xs, const float *xsum, int rows,     \
                            int k, const uint8_t *w, float *out, int n_out) {                    \
        vf acc[TILE];                                                                            \
        int nb = k / 256;                                                                        \
        for (int i = 0; i < rows; i++) acc[i] = vzero();                                         \
        for (int b = 0; b < nb; b++) { /* block16_step's operations, weights in registers */    \
            const uint8_t *blk = w + (size_t)b * (BYTES);                                        \
            block16 p;                                                                           \
            vi isum[TILE];                                                                       \
            T##_prep(blk, &p);                                                                   \
            for (int i = 0; i < rows; i++) {                                                     \
                isum[i] = izero();                                                               \
                if (ADD) add16_into(p.add, xsum + (size_t)i * (k / 16) + (size_t)b * 16, &acc[i]); \
            }                                                                                    \
            _Pragma("GCC unroll 8")                                                              \
            for (int c = 0; c < 8; c++) {                                                        \
                w16 wv = mul16_c(widen(T##_chunk(blk, c)), p.mul, c, MUL32);                     \
                const int16_t *xc = xq + (size_t)(b * 8 + c) * 32;                               \
                for (int i = 0; i < rows; i++)                                                   \
                    isum[i] = iacc_x(isum[i], wv, xload16(xc + (size_t)i * k));                  \
                if (c % FLUSH_EVERY == FLUSH_EVERY - 1)                                          \
                    for (int i = 0; i < rows; i++) {                                             \
                        vf f = vset(p.scale[0] * xs[(size_t)i * nb + b]);                        \
                        acc[i] = vfma(vfloat(isum[i]), f, acc[i]);                               \
                        isum[i] = izero();                                                       \
                    }                                                                            \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < rows; i++) out[(size_t)i * n_out] = vsum(acc[i]);                    \
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
ROUNDED256(q2_k, 84, 1, 0)
ROUNDED256(q3_k, 110, 0, 0)
ROUNDED256(q4_k, 144, 1, 1)
ROUNDED256(q5_k, 176, 1, 1)
ROUNDED256(q6_k, 210, 0, 0)
ROUNDED256(iq4_xs, 136, 0, 1)
#define DOT16(T) T##_dot16
#if VL == 16
#define BUILD16(T) T##_build16
#else  /* AVX2: no faster than the float32 panels (vpmaddwd and an add do 16 products, as two
          float32 FMAs), so many rows take those, exactly */
#define BUILD16(T) NULL
#endif
#else
#define DOT16(T) NULL
#define BUILD16(T) NULL
#endif
