/* Attention over a paged KV cache: each sequence's positions live in fixed-size blocks of one
 * shared pool, found through the sequence's block table, so sequences of any length share one
 * preallocated cache (and two sequences may point at the same blocks for a shared prefix).
 *
 * Cache layout, for one layer: keys and values are (n_blocks, hkv, block_size, d) float32,
 * contiguous. Position p of a sequence with block table `table` lives in block
 * table[p / block_size] at offset p % block_size: the key of kv head h at position p is
 * keys[table[p / block_size], h, p % block_size, :].
 *
 * nbq_paged_lone_attention: one new token of one sequence (a lone decode step): rope on its q
 * and k heads, its k and v written at `pos` through the table, then grouped-query attention
 * over positions 0..pos, by the decode kernel below with a batch of one. out: (hq, d).
 *
 * nbq_paged_decode_attention: a decode batch, one already-roped query token a row, its k and v
 * already written: row b attends to its positions 0..lengths[b]-1 through its table row
 * tables + b * table_stride. q and out: (batch, hq, d). A row of length 0 gets zeros.
 *
 * Both: scale 1/sqrt(d), softmax in float32 (max subtracted); one dot product a position, then
 * the weighted values in position order, so a row's result does not depend on the batch. On
 * AVX2 (and AVX-512) machines, for head dims of whole 8-float vectors, in vectors with FMAs and
 * a polynomial exp (exp8, about 1 ulp from expf); elsewhere in plain C. The work is
 * split over (row, kv head, slice of that kv head's query heads): each slice reads a key or value
 * row once for all its query heads; the slices are cut only as far as needed to give every
 * thread work. Built with -ffp-contract=off (rope rounds as torch's mul, mul, add).
 * Return 0, -1 when out of memory, -2 for invalid arguments (hq not a multiple of hkv, a
 * negative length or table entry, a length past its table row); nothing is written then.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nbserve_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAS_VECTOR_ATTENTION 1

/* e^x for 8 floats (x <= 0 here: scores less their maximum), as Cephes' expf: x = n ln2 + r,
 * |r| <= ln2 / 2, e^r by a degree-6 polynomial, times 2^n through the exponent bits; about
 * 1 ulp from expf; below -87.3 (where float underflows) 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#else
#define HAS_VECTOR_ATTENTION 0
#endif

static int shape_ok(int hq, int hkv, int d, int block_size) {
    return hq > 0 && hkv > 0 && hq % hkv == 0 && d > 0 && block_size > 0;
}

#define KV_T float
#define KV_NAME(name) name
#define KV_VECTOR HAS_VECTOR_ATTENTION
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#include "paged_attention_body.h"
#undef KV_T
#undef KV_NAME
#undef KV_VECTOR
#undef KV_LOAD8

/* The same kernels over a float16 cache (kv_dtype="float16"): half the bytes per token. */
#define KV_T _Float16
#define KV_NAME(name) name##_f16
#if defined(__F16C__)
#define KV_VECTOR HAS_VECTOR_ATTENTION
#else
#define KV_VECTOR 0
#endif
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#include "paged_attention_body.h"
#undef KV_T
#undef KV_NAME
#undef KV_VECTOR
#undef KV_LOAD8
