/* The paged-attention kernels' bodies for one cache element type, included twice by
 * paged_attention.c: KV_T float (names as they are) and KV_T _Float16 (names + "_f16").
 * Keys and values are read as KV_T and computed with in float32. */
/* Query heads q (n, d) of kv head kh over positions 0..length-1 of one table: scores (n rows of
 * score_stride floats, scratch), out (n, d). */
static void KV_NAME(attend)(const float *q, int n, int d, int hkv, int kh, const KV_T *keys,
                   const KV_T *values, int block_size, const int32_t *table, int length,
                   float *scores, size_t score_stride, float *out) {
    const float scale = 1.0f / sqrtf((float)d);
    const size_t head_stride = (size_t)block_size * d, block_stride = (size_t)hkv * head_stride;
    for (int t0 = 0, blk = 0; t0 < length; t0 += block_size, blk++) {
        const KV_T *kb = keys + (size_t)table[blk] * block_stride + (size_t)kh * head_stride;
        int end = length - t0 < block_size ? length - t0 : block_size;
        for (int i = 0; i < end; i++) {
            const KV_T *k = kb + (size_t)i * d;
            for (int g = 0; g < n; g++) {
                const float *qh = q + (size_t)g * d;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int j = 0; j < d; j++) dot += qh[j] * (float)k[j];
                scores[(size_t)g * score_stride + t0 + i] = dot * scale;
            }
        }
    }
    for (int g = 0; g < n; g++) {
        float *s = scores + (size_t)g * score_stride, top = -INFINITY, total = 0.f;
        for (int t = 0; t < length; t++) top = s[t] > top ? s[t] : top;
        for (int t = 0; t < length; t++) {
            s[t] = expf(s[t] - top);
            total += s[t];
        }
        for (int t = 0; t < length; t++) s[t] = s[t] / total;
    }
    memset(out, 0, sizeof(float) * (size_t)n * d);
    for (int t0 = 0, blk = 0; t0 < length; t0 += block_size, blk++) {
        const KV_T *vb = values + (size_t)table[blk] * block_stride + (size_t)kh * head_stride;
        int end = length - t0 < block_size ? length - t0 : block_size;
        for (int i = 0; i < end; i++) {
            const KV_T *v = vb + (size_t)i * d;
            for (int g = 0; g < n; g++) {
                float p = scores[(size_t)g * score_stride + t0 + i];
                float *o = out + (size_t)g * d;
                #pragma omp simd
                for (int j = 0; j < d; j++) o[j] += p * (float)v[j];
            }
        }
    }
}


#if KV_VECTOR
/* Up to VEC_HEADS query heads of one kv head at a time: each key's and value's vectors are
 * read (and, for a float16 cache, converted) once for all of them, not once a head. Each
 * score and output element keeps its own accumulator and order of operations, so the
 * grouping changes no value. */
#ifndef VEC_HEADS
#define VEC_HEADS 3
#endif

/* s[g * stride + i] = scale * (q_g . key i) for the `heads` (<= VEC_HEADS) query heads q
 * (heads, d) and keys 0..end-1 of one block (kb, d apart): four keys a horizontal sum. */
static inline __attribute__((always_inline)) void KV_NAME(scores_vec)(
        const float *q, int heads, int d, const KV_T *kb, int end, float scale, float *s,
        size_t stride) {
    int i = 0;
    for (; i + 4 <= end; i += 4) {
        __m256 a[VEC_HEADS][4];
        for (int g = 0; g < heads; g++)
            for (int r = 0; r < 4; r++) a[g][r] = _mm256_setzero_ps();
        const KV_T *k = kb + (size_t)i * d;
        for (int j = 0; j < d; j += 8)
            for (int r = 0; r < 4; r++) {
                __m256 kv = KV_LOAD8(k + (size_t)r * d + j);
                for (int g = 0; g < heads; g++)
                    a[g][r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)g * d + j), kv, a[g][r]);
            }
        for (int g = 0; g < heads; g++) {
            __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]),
                                      _mm256_hadd_ps(a[g][2], a[g][3]));
            __m128 four = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(s + (size_t)g * stride + i, _mm_mul_ps(four, _mm_set1_ps(scale)));
        }
    }
    for (; i < end; i++) {
        __m256 a[VEC_HEADS];
        for (int g = 0; g < heads; g++) a[g] = _mm256_setzero_ps();
        const KV_T *k = kb + (size_t)i * d;
        for (int j = 0; j < d; j += 8) {
            __m256 kv = KV_LOAD8(k + j);
            for (int g = 0; g < heads; g++)
                a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)g * d + j), kv, a[g]);
        }
        for (int g = 0; g < heads; g++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(a[g]), _mm256_extractf128_ps(a[g], 1));
            h = _mm_hadd_ps(h, h);
            h = _mm_hadd_ps(h, h);
            s[(size_t)g * stride + i] = _mm_cvtss_f32(h) * scale;
        }
    }
}

/* out_g (d) = sum over positions t in order of s_g[t] * value t, for the `heads` (<=
 * VEC_HEADS) query heads (probabilities s, `stride` apart): 32 dims at a time in registers. */
static inline __attribute__((always_inline)) void KV_NAME(values_vec)(
        const float *s, size_t stride, int heads, int d, int hkv, int kh, const KV_T *values,
        int block_size, const int32_t *table, int length, float *out) {
    const size_t head_stride = (size_t)block_size * d, block_stride = (size_t)hkv * head_stride;
    for (int c = 0; c < d; c += 32) {
        int width = d - c < 32 ? (d - c) / 8 : 4;
        __m256 acc[VEC_HEADS][4];
        for (int g = 0; g < heads; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
        for (int t0 = 0, blk = 0; t0 < length; t0 += block_size, blk++) {
            const KV_T *vb = values + (size_t)table[blk] * block_stride + (size_t)kh * head_stride
                             + c;
            int end = length - t0 < block_size ? length - t0 : block_size;
            for (int i = 0; i < end; i++) {
                const KV_T *v = vb + (size_t)i * d;
                for (int j = 0; j < width; j++) {
                    __m256 vv = KV_LOAD8(v + 8 * j);
                    for (int g = 0; g < heads; g++)
                        acc[g][j] = _mm256_fmadd_ps(_mm256_set1_ps(s[(size_t)g * stride + t0 + i]),
                                                    vv, acc[g][j]);
                }
            }
        }
        for (int g = 0; g < heads; g++)
            for (int j = 0; j < width; j++)
                _mm256_storeu_ps(out + (size_t)g * d + c + 8 * j, acc[g][j]);
    }
}
#endif

#if KV_VECTOR
/* `attend` in 8-lane vectors, for d a multiple of 8: the scores four keys at a time (one
 * horizontal sum for four dot products), exp in vectors (exp8), the outputs accumulated in
 * registers over the positions; up to VEC_HEADS query heads share each key and value read. */
static void KV_NAME(attend_vec)(const float *q, int n, int d, int hkv, int kh, const KV_T *keys,
                                const KV_T *values, int block_size, const int32_t *table,
                                int length, float *scores, size_t score_stride, float *out) {
    const float scale = 1.0f / sqrtf((float)d);
    const size_t head_stride = (size_t)block_size * d, block_stride = (size_t)hkv * head_stride;
    for (int t0 = 0, blk = 0; t0 < length; t0 += block_size, blk++) {
        const KV_T *kb = keys + (size_t)table[blk] * block_stride + (size_t)kh * head_stride;
        int end = length - t0 < block_size ? length - t0 : block_size;
        for (int g0 = 0; g0 < n; g0 += VEC_HEADS) {
            int heads = n - g0 < VEC_HEADS ? n - g0 : VEC_HEADS;
            if (heads == VEC_HEADS)
                KV_NAME(scores_vec)(q + (size_t)g0 * d, VEC_HEADS, d, kb, end, scale,
                                    scores + (size_t)g0 * score_stride + t0, score_stride);
            else if (heads == 2)
                KV_NAME(scores_vec)(q + (size_t)g0 * d, 2, d, kb, end, scale,
                                    scores + (size_t)g0 * score_stride + t0, score_stride);
            else
                KV_NAME(scores_vec)(q + (size_t)g0 * d, 1, d, kb, end, scale,
                                    scores + (size_t)g0 * score_stride + t0, score_stride);
        }
    }
    for (int g = 0; g < n; g++) {
        float *s = scores + (size_t)g * score_stride, top = -INFINITY;
        for (int t = 0; t < length; t++) top = s[t] > top ? s[t] : top;
        __m256 vtop = _mm256_set1_ps(top), vsum = _mm256_setzero_ps();
        int t = 0;
        for (; t + 8 <= length; t += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vtop));
            _mm256_storeu_ps(s + t, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float tail[8] = {0}, total = 0.f;
        for (int r = 0; t + r < length; r++) tail[r] = s[t + r] - top;
        __m256 e = exp8(_mm256_loadu_ps(tail));
        _mm256_storeu_ps(tail, e);
        for (int r = 0; t + r < length; r++) { s[t + r] = tail[r]; total += tail[r]; }
        float lanes[8];
        _mm256_storeu_ps(lanes, vsum);
        for (int r = 0; r < 8; r++) total += lanes[r];
        __m256 inv = _mm256_set1_ps(1.0f / total);
        for (t = 0; t + 8 <= length; t += 8)
            _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
        for (; t < length; t++) s[t] = s[t] / total;
    }
    for (int g0 = 0; g0 < n; g0 += VEC_HEADS) {
        int heads = n - g0 < VEC_HEADS ? n - g0 : VEC_HEADS;
        const float *s = scores + (size_t)g0 * score_stride;
        float *o = out + (size_t)g0 * d;
        if (heads == VEC_HEADS)
            KV_NAME(values_vec)(s, score_stride, VEC_HEADS, d, hkv, kh, values, block_size,
                                table, length, o);
        else if (heads == 2)
            KV_NAME(values_vec)(s, score_stride, 2, d, hkv, kh, values, block_size, table,
                                length, o);
        else
            KV_NAME(values_vec)(s, score_stride, 1, d, hkv, kh, values, block_size, table,
                                length, o);
    }
}
#endif

int KV_NAME(nbq_paged_decode_attention)(const float *q, int batch, int hq, int hkv, int d,
                               const KV_T *keys, const KV_T *values, int block_size,
                               const int32_t *tables, int table_stride, const int32_t *lengths,
                               float *out, int threads) {
    if (!shape_ok(hq, hkv, d, block_size) || batch < 0 || table_stride < 0) return -2;
    int max_len = 0;
    for (int b = 0; b < batch; b++) {
        int length = lengths[b];
        if (length < 0 || (long long)length > (long long)table_stride * block_size) return -2;
        const int32_t *table = tables + (size_t)b * table_stride;
        for (int blk = 0; blk < (length + block_size - 1) / block_size; blk++)
            if (table[blk] < 0) return -2;
        max_len = length > max_len ? length : max_len;
    }
    if (batch == 0) return 0;
    if (threads < 1) threads = 1;
    size_t cells = (size_t)batch * hq * max_len;
    float *scores = malloc(sizeof(float) * (cells ? cells : 1));
    if (!scores) return -1;
    /* work items: (row, kv head, slice of its group), slices only as many as keep threads busy */
    int group = hq / hkv;
    long long pairs = (long long)batch * hkv;
    int slices = 1;
    if (threads > pairs) {
        long long want = (threads + pairs - 1) / pairs;
        slices = want < group ? (int)want : group;
    }
    int per = (group + slices - 1) / slices;
    slices = (group + per - 1) / per;
    long long items = pairs * slices;
    #pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (long long item = 0; item < items; item++) {
        int slice = (int)(item % slices), kh = (int)(item / slices % hkv);
        int b = (int)(item / slices / hkv), first = kh * group + slice * per;
        int n = group - slice * per < per ? group - slice * per : per;
        size_t at = (size_t)b * hq + first;
#if KV_VECTOR
        if (d % 8 == 0) {
            KV_NAME(attend_vec)(q + at * d, n, d, hkv, kh, keys, values, block_size,
                                tables + (size_t)b * table_stride, lengths[b],
                                scores + at * max_len, (size_t)max_len, out + at * d);
            continue;
        }
#endif
        KV_NAME(attend)(q + at * d, n, d, hkv, kh, keys, values, block_size,
               tables + (size_t)b * table_stride, lengths[b], scores + at * max_len,
               (size_t)max_len, out + at * d);
    }
    free(scores);
    return 0;
}

/* Rope one token's q heads into q (hq, d) and its k heads into the cache, and write its v,
 * at position pos of a sequence whose block table is `table`. heads (hq + 2 hkv, d). */
static void KV_NAME(rope_and_write)(const float *heads, int hq, int hkv, int d,
                                    const float *cos, const float *sin_signed, KV_T *keys,
                                    KV_T *values, int block_size, const int32_t *table, int pos,
                                    float *q) {
    const int half = d / 2;
    const size_t head_stride = (size_t)block_size * d;
    const size_t slot = (size_t)table[pos / block_size] * hkv * head_stride
                        + (size_t)(pos % block_size) * d;
    for (int h = 0; h < hq; h++) {  /* rope on the query heads */
        const float *x = heads + (size_t)h * d;
        float *to = q + (size_t)h * d;
        for (int j = 0; j < d; j++) to[j] = x[j] * cos[j] + x[(j + half) % d] * sin_signed[j];
    }
    for (int h = 0; h < hkv; h++) {  /* rope on the key heads, stored in the cache's type */
        const float *x = heads + (size_t)(hq + h) * d;
        KV_T *to = keys + slot + (size_t)h * head_stride;
        for (int j = 0; j < d; j++)
            to[j] = (KV_T)(x[j] * cos[j] + x[(j + half) % d] * sin_signed[j]);
    }
    for (int h = 0; h < hkv; h++) {
        const float *x = heads + (size_t)(hq + hkv + h) * d;
        KV_T *to = values + slot + (size_t)h * head_stride;
        for (int j = 0; j < d; j++) to[j] = (KV_T)x[j];
    }
}

int KV_NAME(nbq_paged_lone_attention)(const float *heads, int hq, int hkv, int d, const float *cos,
                             const float *sin_signed, KV_T *keys, KV_T *values, int block_size,
                             const int32_t *table, int pos, float *out, int threads) {
    if (!shape_ok(hq, hkv, d, block_size) || pos < 0) return -2;
    for (int blk = 0; blk <= pos / block_size; blk++)
        if (table[blk] < 0) return -2;
    float *q = malloc(sizeof(float) * (size_t)hq * d);
    if (!q) return -1;
    const int length = pos + 1;
    KV_NAME(rope_and_write)(heads, hq, hkv, d, cos, sin_signed, keys, values, block_size, table,
                            pos, q);
    int failed = KV_NAME(nbq_paged_decode_attention)(q, 1, hq, hkv, d, keys, values, block_size, table,
                                            pos / block_size + 1, &length, out, threads);
    free(q);
    return failed;
}

/* A decode batch's whole attention: for each row b, its token's heads (hq + 2 hkv, d) at
 * heads + b * (hq + 2 hkv) * d, roped with its own cos / sin_signed rows (b * d), its k and v
 * written at positions[b] through its table row, then every row's attention over positions
 * 0..positions[b] (the decode kernel). Rows are written before any row attends; two rows must
 * not write one block's slot (the engine never gives two running sequences the same
 * position in a shared block). */
int KV_NAME(nbq_paged_decode_step)(const float *heads, int batch, int hq, int hkv, int d,
                                   const float *cos, const float *sin_signed, KV_T *keys,
                                   KV_T *values, int block_size, const int32_t *tables,
                                   int table_stride, const int32_t *positions, float *out,
                                   int threads) {
    if (!shape_ok(hq, hkv, d, block_size) || batch < 0 || table_stride < 0) return -2;
    for (int b = 0; b < batch; b++) {
        int pos = positions[b];
        if (pos < 0 || (long long)pos >= (long long)table_stride * block_size) return -2;
        const int32_t *table = tables + (size_t)b * table_stride;
        for (int blk = 0; blk <= pos / block_size; blk++)
            if (table[blk] < 0) return -2;
    }
    if (batch == 0) return 0;
    float *q = malloc(sizeof(float) * (size_t)batch * hq * d);
    int32_t *lengths = malloc(sizeof(int32_t) * (size_t)batch);
    if (!q || !lengths) { free(q); free(lengths); return -1; }
    const size_t width = (size_t)(hq + 2 * hkv) * d;
    for (int b = 0; b < batch; b++) {
        lengths[b] = positions[b] + 1;
        KV_NAME(rope_and_write)(heads + b * width, hq, hkv, d, cos + (size_t)b * d,
                                sin_signed + (size_t)b * d, keys, values, block_size,
                                tables + (size_t)b * table_stride, positions[b],
                                q + (size_t)b * hq * d);
    }
    int failed = KV_NAME(nbq_paged_decode_attention)(q, batch, hq, hkv, d, keys, values,
                                                     block_size, tables, table_stride, lengths,
                                                     out, threads);
    free(q);
    free(lengths);
    return failed;
}
