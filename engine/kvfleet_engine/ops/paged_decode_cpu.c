/*
 * Paged decode attention for CPUs (float32): one query token per sequence, K/V read in place from
 * the paged cache, so no gathered copy of the context is ever made (the torch path copies every
 * sequence's pages each step, tripling the memory traffic that dominates decode).
 *
 * Layout: q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [B, stride]
 * int32; seq_lens [B] int32; out [B, H, D]. Query head h reads KV head h / (H / KVH).
 *
 * Per (sequence, KV head): scores for the whole context into a scratch row per query head, an exact
 * softmax (max, exp, sum), then the probability-weighted sum of V: the same arithmetic as
 * softmax(q k^T * scale) v, with K and V each read once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for the softmax (x <= 0 after subtracting the max), written so the compiler can vectorize it:
 * libm's expf is a scalar call per element, which made the softmax the kernel's bottleneck. Range
 * reduction x = n ln2 + r with ln2 split in two (Cody-Waite), e^r by its minimax polynomial on
 * [-ln2/2, ln2/2], 2^n assembled in the exponent bits. Relative error ~1e-7 (a few ulp). */
static inline float softmax_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f;
}

/* One (sequence, KV head): its G query heads against the sequence's pages. Inlined with a literal D for
 * the common head sizes, so the dot products and V updates unroll into straight vector code. */
static inline __attribute__((always_inline)) void decode_one(
    const float *restrict qb, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, int L, int G, const int D, int block_size, int64_t token_stride,
    int64_t block_stride, int64_t head_offset, float scale, float *restrict scores, float *restrict acc,
    float *restrict ob) {
    const int num_blocks = (L + block_size - 1) / block_size;
    /* Pass 1: scores, page by page (no division per token). */
    for (int blk = 0; blk < num_blocks; blk++) {
        const float *kb = k_cache + (int64_t)table[blk] * block_stride + head_offset;
        const int base = blk * block_size;
        const int n = L - base < block_size ? L - base : block_size;
        for (int t = 0; t < n; t++) {
            const float *kp = kb + (int64_t)t * token_stride;
            for (int g = 0; g < G; g++) {
                const float *qg = qb + (int64_t)g * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s += qg[d] * kp[d];
                scores[(int64_t)g * L + base + t] = s * scale;
            }
        }
    }
    /* Softmax per query head. */
    for (int g = 0; g < G; g++) {
        float *sg = scores + (int64_t)g * L;
        float m = sg[0];
#pragma omp simd reduction(max : m)
        for (int pos = 1; pos < L; pos++) m = sg[pos] > m ? sg[pos] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int pos = 0; pos < L; pos++) {
            const float e = softmax_exp(sg[pos] - m);
            sg[pos] = e;
            sum += e;
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int pos = 0; pos < L; pos++) sg[pos] *= inv;
    }
    /* Pass 2: weighted sum of V into the accumulators. */
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int blk = 0; blk < num_blocks; blk++) {
        const float *vb = v_cache + (int64_t)table[blk] * block_stride + head_offset;
        const int base = blk * block_size;
        const int n = L - base < block_size ? L - base : block_size;
        for (int t = 0; t < n; t++) {
            const float *vp = vb + (int64_t)t * token_stride;
            for (int g = 0; g < G; g++) {
                const float p = scores[(int64_t)g * L + base + t];
                float *ag = acc + (int64_t)g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) ag[d] += p * vp[d];
            }
        }
    }
    memcpy(ob, acc, sizeof(float) * (size_t)G * D);
}

int kvf_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                         float *out, int B, int H, int KVH, int D, int block_size, float scale,
                         int max_seq_len, int num_threads) {
    const int G = H / KVH;
    const int64_t token_stride = (int64_t)KVH * D;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        /* Per thread: scores [G, max_seq_len] and the output accumulators [G, D]. */
        const size_t max_len = (size_t)(max_seq_len > 0 ? max_seq_len : 1);
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * max_len);
        float *acc = (float *)malloc(sizeof(float) * (size_t)G * (size_t)D);
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t work = 0; work < (int64_t)B * KVH; work++) {
            if (!scores || !acc) continue;
            const int b = (int)(work / KVH), kvh = (int)(work % KVH);
            const int L = seq_lens[b];
            const int32_t *table = block_tables + (int64_t)b * bt_stride;
            const float *qb = q + ((int64_t)b * H + (int64_t)kvh * G) * D;
            float *ob = out + ((int64_t)b * H + (int64_t)kvh * G) * D;
            const int64_t off = (int64_t)kvh * D;
            if (L <= 0) {
                memset(ob, 0, sizeof(float) * (size_t)G * D);
            } else if (D == 64) {
                decode_one(qb, k_cache, v_cache, table, L, G, 64, block_size, token_stride, block_stride, off,
                           scale, scores, acc, ob);
            } else if (D == 128) {
                decode_one(qb, k_cache, v_cache, table, L, G, 128, block_size, token_stride, block_stride, off,
                           scale, scores, acc, ob);
            } else {
                decode_one(qb, k_cache, v_cache, table, L, G, D, block_size, token_stride, block_stride, off,
                           scale, scores, acc, ob);
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
