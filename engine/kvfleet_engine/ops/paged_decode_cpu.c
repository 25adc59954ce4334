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
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)(max_seq_len > 0 ? max_seq_len : 1));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t work = 0; work < (int64_t)B * KVH; work++) {
            if (!scores) continue;
            const int b = (int)(work / KVH), kvh = (int)(work % KVH);
            const int L = seq_lens[b];
            const int32_t *table = block_tables + (int64_t)b * bt_stride;
            const float *qb = q + ((int64_t)b * H + (int64_t)kvh * G) * D;
            float *ob = out + ((int64_t)b * H + (int64_t)kvh * G) * D;
            if (L <= 0) {
                memset(ob, 0, sizeof(float) * (size_t)G * D);
                continue;
            }
            /* Pass 1: scores. */
            for (int pos = 0; pos < L; pos++) {
                const float *kp = k_cache + (int64_t)table[pos / block_size] * block_stride +
                                  (int64_t)(pos % block_size) * token_stride + (int64_t)kvh * D;
                for (int g = 0; g < G; g++) {
                    const float *qg = qb + (int64_t)g * D;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < D; d++) s += qg[d] * kp[d];
                    scores[(int64_t)g * L + pos] = s * scale;
                }
            }
            /* Softmax per query head. */
            for (int g = 0; g < G; g++) {
                float *sg = scores + (int64_t)g * L;
                float m = sg[0];
                for (int pos = 1; pos < L; pos++) m = sg[pos] > m ? sg[pos] : m;
                float sum = 0.f;
                for (int pos = 0; pos < L; pos++) {
                    sg[pos] = expf(sg[pos] - m);
                    sum += sg[pos];
                }
                const float inv = 1.f / sum;
                for (int pos = 0; pos < L; pos++) sg[pos] *= inv;
                memset(ob + (int64_t)g * D, 0, sizeof(float) * (size_t)D);
            }
            /* Pass 2: weighted sum of V. */
            for (int pos = 0; pos < L; pos++) {
                const float *vp = v_cache + (int64_t)table[pos / block_size] * block_stride +
                                  (int64_t)(pos % block_size) * token_stride + (int64_t)kvh * D;
                for (int g = 0; g < G; g++) {
                    const float p = scores[(int64_t)g * L + pos];
                    float *og = ob + (int64_t)g * D;
#pragma omp simd
                    for (int d = 0; d < D; d++) og[d] += p * vp[d];
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
