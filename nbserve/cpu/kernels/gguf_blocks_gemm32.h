/* gguf_blocks.c's products of many input rows for the 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0, IQ4_NL) over the input rounded to 16 bits per 32 (NBQ_ROUND16: round16, as their row
 * kernels take it), included once by it after gguf_blocks_gemm8.h, whose lane helpers it uses
 * (AVX-512 with VNNI, AVX2); BUILD32(T) is NULL elsewhere, where those products take the
 * float32 panels.
 *
 * Past ROW_PATH_MAX rows (decode batches, prompt chunks) these types took the float32 panels:
 * every weight row dequantized to float32 once per call, then float32 FMAs. Here, as in gemm8,
 * G8_LANES weight rows are built once per chunk of input rows into one 32-bit lane each, a
 * lane holding two neighbouring weights' integer codes as int16 (Q8_0's bytes, Q4_0's nibble
 * - 8, Q5_0's five bits - 16, IQ4_NL's table values, Q4_1's and Q5_1's unsigned codes), so one
 * vpdpwssd (AVX2: vpmaddwd and an add) with two 16-bit inputs broadcast multiplies 32 (16)
 * pairs. A block's 32 products add up in int32 (at most 32 x 128 x 32767 < 2^31), converted once
 * and multiplied by d times the input's scale; Q4_1's and Q5_1's m meets the input's sums. So
 * the product is the 16-bit input's with gguf's weights up to float32 rounding, as the row
 * kernels' (T_dot16) with the float sums in another order: a row's product is the same bits in
 * any batch of more than ROW_PATH_MAX rows, as in any of up to ROW_PATH_MAX, the two within
 * float32 rounding of each other. */
#if defined(HAS_GEMM8)
#define HAS_GEMM32 1

/* One block (32 weights) of G8_LANES weight rows: pairs[t] each row's codes 2t, 2t + 1 as
 * int16; d and m (Q4_1's and Q5_1's, else 0) per row. Rows past the tensor's are zero. */
typedef struct __attribute__((aligned(64))) built32 {
    int32_t pairs[16][G8_LANES];
    float d[G8_LANES], m[G8_LANES];
} built32;

/* A block's 32 signed codes (in order) and its d, m */
typedef void (*codes32_fn)(const uint8_t *blk, int8_t *codes, float *d, float *m);

INLINE void nibbles32(const uint8_t *qs, int bias, int8_t *codes) {  /* Q4_0's order */
    __m128i n = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    __m128i b = _mm_set1_epi8((char)bias);
    _mm_storeu_si128((__m128i *)codes, _mm_sub_epi8(_mm_and_si128(n, low4), b));
    _mm_storeu_si128((__m128i *)(codes + 16),
                     _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(n, 4), low4), b));
}
INLINE void fifth32(const uint8_t *qs, uint32_t qh, int bias, int8_t *codes) {  /* Q5_0's */
    __m128i c[2], b = _mm_set1_epi8((char)bias);
    q5_codes16(qs, qh, c);
    _mm_storeu_si128((__m128i *)codes, _mm_sub_epi8(c[0], b));
    _mm_storeu_si128((__m128i *)(codes + 16), _mm_sub_epi8(c[1], b));
}
INLINE void q4_0_codes32(const uint8_t *b, int8_t *codes, float *d, float *m) {
    nibbles32(b + 2, 8, codes);
    *d = half_at(b);
    *m = 0.f;
}
INLINE void q4_1_codes32(const uint8_t *b, int8_t *codes, float *d, float *m) {
    nibbles32(b + 4, 0, codes);
    *d = half_at(b);
    *m = half_at(b + 2);
}
INLINE void q5_0_codes32(const uint8_t *b, int8_t *codes, float *d, float *m) {
    fifth32(b + 6, u32_at(b + 2), 16, codes);
    *d = half_at(b);
    *m = 0.f;
}
INLINE void q5_1_codes32(const uint8_t *b, int8_t *codes, float *d, float *m) {
    fifth32(b + 8, u32_at(b + 4), 0, codes);
    *d = half_at(b);
    *m = half_at(b + 2);
}
INLINE void q8_0_codes32(const uint8_t *b, int8_t *codes, float *d, float *m) {
    memcpy(codes, b + 2, 32);
    *d = half_at(b);
    *m = 0.f;
}
INLINE void iq4_nl_codes32(const uint8_t *b, int8_t *codes, float *d, float *m) {
    iq4_lookup(b + 2, 0, codes);
    iq4_lookup(b + 2, 4, codes + 16);
    *d = half_at(b);
    *m = 0.f;
}

/* nw <= G8_LANES weight rows' block (rows row_bytes apart) built into o; codes_of inlined */
INLINE void build32(codes32_fn codes_of, const uint8_t *w, size_t row_bytes, int nw,
                    built32 *o) {
    int8_t codes[G8_LANES][32] __attribute__((aligned(32)));
    for (int j = 0; j < G8_LANES; j++) {
        if (j < nw) {
            codes_of(w + (size_t)j * row_bytes, codes[j], &o->d[j], &o->m[j]);
        } else {
            memset(codes[j], 0, 32);
            o->d[j] = o->m[j] = 0.f;
        }
    }
    for (int h = 0; h < 16 / G8_LANES; h++) {  /* AVX2: pairs 0-7, then 8-15 */
        g8i r[G8_LANES];
        for (int j = 0; j < G8_LANES; j++) {
#if VL == 16
            r[j] = _mm512_cvtepi8_epi16(_mm256_load_si256((const __m256i *)codes[j]));
#else
            r[j] = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)(codes[j] + 16 * h)));
#endif
        }
        g8_transpose(r);
        for (int t = 0; t < G8_LANES; t++) g8_store(o->pairs[G8_LANES * h + t], r[t]);
    }
}
/* T_build32: build32 with T's codes, the function gemm32 takes for T */
#define BUILD32_OF(T)                                                                            \
    static void T##_build32(const uint8_t *w, size_t row_bytes, int nw, void *o) {               \
        build32(T##_codes32, w, row_bytes, nw, (built32 *)o);                                    \
    }
BUILD32_OF(q4_0) BUILD32_OF(q4_1) BUILD32_OF(q5_0) BUILD32_OF(q5_1) BUILD32_OF(q8_0)
BUILD32_OF(iq4_nl)

/* part + codes . (the two int16 at x in every lane); on AVX-512 the broadcast inside the
 * instruction ({1to16}: GCC loads it into a register first, one more uop a product; 5-9%
 * faster at 64 rows on Zen 4) */
INLINE g8i pairs_bcast(g8i part, g8i codes, const int16_t *x) {
#if VL == 16
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(part) : "v"(codes), "m"(*(const int32_t *)x));
    return part;
#else
    return g8_pairs(part, codes, g8_bcast4(x));
#endif
}

/* y[i n_out + j] (j < nw) = input row i (x: 16-bit codes, rows k apart; xs its scales per 32,
 * rows k / 32 apart; xsum its sums per 16, rows k / 16 apart) times the built rows (wb: k / 32
 * blocks) for nr input rows, the accumulators in registers over the whole row; mins: Q4_1's and
 * Q5_1's m times the input's sums. */
INLINE void tile32(const int16_t *restrict x, int k, const float *restrict xs,
                   const float *restrict xsum, const built32 *restrict wb, int nr, int mins,
                   float *y, int n_out, int nw) {
    g8f acc[G8_C];
    int nb = k / 32;
    for (int i = 0; i < nr; i++) acc[i] = g8_fzero();
    for (int b = 0; b < nb; b++) {
        const built32 *w = wb + b;
        g8i part[G8_C];
        for (int i = 0; i < nr; i++) part[i] = g8_zero();
        for (int t = 0; t < 16; t++) {
            g8i codes = g8_load(w->pairs[t]);
            for (int i = 0; i < nr; i++)
                part[i] = pairs_bcast(part[i], codes, x + (size_t)i * k + 32 * b + 2 * t);
        }
        g8f d = g8_fload(w->d);
        for (int i = 0; i < nr; i++)
            acc[i] = g8_fmadd(g8_float(part[i]), g8_fmul(d, g8_fset1(xs[(size_t)i * nb + b])),
                              acc[i]);
        if (mins) {
            g8f m = g8_fload(w->m);
            for (int i = 0; i < nr; i++) {
                const float *su = xsum + (size_t)i * (k / 16) + 2 * b;
                acc[i] = g8_fmadd(m, g8_fset1(su[0] + su[1]), acc[i]);
            }
        }
    }
    for (int i = 0; i < nr; i++) g8_fstore(y + (size_t)i * n_out, acc[i], nw);
}

#define TILE32_CASE(NR)                                                                          \
    case NR:                                                                                     \
        if (mins)                                                                                \
            tile32(x, k, xs, xsum, wb, NR, 1, y, n_out, nw);                                     \
        else                                                                                     \
            tile32(x, k, xs, xsum, wb, NR, 0, y, n_out, nw);                                     \
        break;
static void tile32_any(const int16_t *x, int k, const float *xs, const float *xsum,
                       const built32 *wb, int nr, int mins, float *y, int n_out, int nw) {
    switch (nr) {
        TILE32_CASE(1) TILE32_CASE(2) TILE32_CASE(3) TILE32_CASE(4)
#if G8_C == 8
        TILE32_CASE(5) TILE32_CASE(6) TILE32_CASE(7) TILE32_CASE(8)
#endif
    }
}

typedef struct {  /* gemm32's input: round16's codes, scales per 32, sums per 16 */
    const int16_t *x;
    const float *xs, *xsum;
    int mins;
} input32;

static void tile32_job(const lanes_job *job, int i, int nr, const char *built, float *y,
                       int nw) {
    const input32 *in = job->input;
    int k = job->k;
    tile32_any(in->x + (size_t)i * k, k, in->xs + (size_t)i * (k / 32),
               in->xsum + (size_t)i * (k / 16), (const built32 *)built, nr, in->mins, y, job->n,
               nw);
}

/* y (rows, n) = the 16-bit input (rows > ROW_PATH_MAX; round16's xq (rows, k), xs (rows,
 * k / 32), xsum (rows, k / 16)) times n weight rows of a 32-weight type (`build` a block,
 * `bytes` a block) through lanes_gemm. Returns 0, -1 when out of memory. */
static int blocks_gemm32(void (*build)(const uint8_t *, size_t, int, void *), int mins,
                         int bytes, const int16_t *xq, const float *xs, const float *xsum,
                         int rows, int k, const uint8_t *w, int n, float *y, int threads) {
    input32 in = {xq, xs, xsum, mins};
    lanes_job job = {w, (size_t)(k / 32) * bytes, sizeof(built32), bytes, k / 32, n, k,
                     lanes_chunk(k, 2), build, tile32_job, &in};
    return lanes_gemm(&job, rows, y, threads);
}
#define BUILD32(T) T##_build32
#else
#define BUILD32(T) NULL
#endif
