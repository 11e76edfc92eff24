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
 * the weighted values in position order, so a row's result does not depend on the batch. The work is
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

static int shape_ok(int hq, int hkv, int d, int block_size) {
    return hq > 0 && hkv > 0 && hq % hkv == 0 && d > 0 && block_size > 0;
}

#define KV_T float
#define KV_NAME(name) name
#include "paged_attention_body.h"
#undef KV_T
#undef KV_NAME

/* The same kernels over a float16 cache (kv_dtype="float16"): half the bytes per token. */
#define KV_T _Float16
#define KV_NAME(name) name##_f16
#include "paged_attention_body.h"
#undef KV_T
#undef KV_NAME
