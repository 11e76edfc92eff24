/* One new token of one sequence through causal self-attention: the attention of a lone decode
 * step (nbserve's single-stream case), in one call instead of about fifteen torch ops.
 *
 * heads: the q/k/v projection of the token, (hq + 2 hkv, d) float32, before rotary embedding.
 * cos, sin_signed: the rotary tables at the token's position (d,), as nbserve's apply_rope uses
 * them: rope(x) = x * cos + roll(x, d/2) * sin_signed. keys, values: this sequence's cache,
 * (hkv, ctx, d); the token's k (after rope) and v are written at `pos`, then every query head
 * attends to positions 0..pos of its kv head (grouped-query attention: hq / hkv query heads per
 * kv head). out: (hq, d). Built with -ffp-contract=off: rope rounds as torch's mul, mul, add.
 * Returns 0, or -1 when out of memory.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

int nbq_lone_attention(const float *heads, int hq, int hkv, int d, const float *cos,
                       const float *sin_signed, float *keys, float *values, int ctx, int pos,
                       float *out, int threads) {
    int group = hq / hkv, half = d / 2, length = pos + 1;
    float *q = malloc(sizeof(float) * (size_t)hq * d);
    float *scores = malloc(sizeof(float) * (size_t)hq * length);
    if (!q || !scores) {
        free(q);
        free(scores);
        return -1;
    }
    for (int h = 0; h < hq + hkv; h++) {  /* rope on the query and key heads */
        const float *x = heads + (size_t)h * d;
        float *to = h < hq ? q + (size_t)h * d : keys + ((size_t)(h - hq) * ctx + pos) * d;
        for (int j = 0; j < d; j++) to[j] = x[j] * cos[j] + x[(j + half) % d] * sin_signed[j];
    }
    for (int h = 0; h < hkv; h++)
        memcpy(values + ((size_t)h * ctx + pos) * d, heads + (size_t)(hq + hkv + h) * d,
               sizeof(float) * d);
    float scale = 1.0f / sqrtf((float)d);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int h = 0; h < hq; h++) {
        const float *k = keys + (size_t)(h / group) * ctx * d;
        const float *v = values + (size_t)(h / group) * ctx * d;
        const float *qh = q + (size_t)h * d;
        float *s = scores + (size_t)h * length, top = -INFINITY, total = 0.f;
        for (int t = 0; t < length; t++) {
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int j = 0; j < d; j++) dot += qh[j] * k[(size_t)t * d + j];
            s[t] = dot * scale;
            top = s[t] > top ? s[t] : top;
        }
        for (int t = 0; t < length; t++) {
            s[t] = expf(s[t] - top);
            total += s[t];
        }
        float *o = out + (size_t)h * d;
        memset(o, 0, sizeof(float) * d);
        for (int t = 0; t < length; t++) {
            float p = s[t] / total;
            #pragma omp simd
            for (int j = 0; j < d; j++) o[j] += p * v[(size_t)t * d + j];
        }
    }
    free(q);
    free(scores);
    return 0;
}
