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
 *
 * Why it is shaped like this: a q.k dot product is D multiply-adds into one SIMD register and then a
 * horizontal sum across the register's lanes, which costs as much as the multiply-adds themselves.
 * The context is therefore walked in chunks of VL keys (VL = SIMD width in floats): the VL per-key
 * partial-sum registers are folded together by a transposing reduction tree (log2(VL) levels, VL - 1
 * two-register shuffles + adds in all) whose result holds the VL scores in key order, one per lane.
 * That is one shuffle+add per key instead of one full horizontal sum per key. The weighted V sum is
 * a plain broadcast multiply-add per key and needs no reduction.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8 /* AVX2 / SSE machines: GCC lowers the 8-wide vector type to whatever the target has */
#endif

/* GCC vector extension types: portable source, compiled to the target's SIMD instructions. The
 * unaligned, may_alias variant is how K/V rows and scratch are loaded and stored. */
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }

/* exp(x) for the softmax (x <= 0 after subtracting the max), written so the compiler can vectorize it:
 * libm's expf is a scalar call per element. Range reduction x = n ln2 + r with ln2 split in two
 * (Cody-Waite), e^r by its minimax polynomial on [-ln2/2, ln2/2], 2^n assembled in the exponent bits.
 * Relative error ~1e-7 (a few ulp). */
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

/* Transposing reduction: s[t] holds key t's partial sums spread over VL lanes; the result's lane t
 * is the full sum of s[t]. Each level adds the low and high halves of every group of lanes while
 * packing two registers into one, so the keys stay in order. */
#if VL == 16
#define FOLD(a, b, lo, hi) (__builtin_shufflevector(a, b, lo) + __builtin_shufflevector(a, b, hi))
#define L1_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define L1_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define L2_LO 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define L2_HI 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define L3_LO 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define L3_HI 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define L4_LO 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define L4_HI 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
static inline vf reduce_keys(const vf *s) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = FOLD(s[2 * i], s[2 * i + 1], L1_LO, L1_HI);
    for (int i = 0; i < 4; i++) b[i] = FOLD(a[2 * i], a[2 * i + 1], L2_LO, L2_HI);
    for (int i = 0; i < 2; i++) c[i] = FOLD(b[2 * i], b[2 * i + 1], L3_LO, L3_HI);
    return FOLD(c[0], c[1], L4_LO, L4_HI);
}
#else
#define FOLD(a, b, lo, hi) (__builtin_shufflevector(a, b, lo) + __builtin_shufflevector(a, b, hi))
#define L1_LO 0, 1, 2, 3, 8, 9, 10, 11
#define L1_HI 4, 5, 6, 7, 12, 13, 14, 15
#define L2_LO 0, 1, 4, 5, 8, 9, 12, 13
#define L2_HI 2, 3, 6, 7, 10, 11, 14, 15
#define L3_LO 0, 2, 4, 6, 8, 10, 12, 14
#define L3_HI 1, 3, 5, 7, 9, 11, 13, 15
static inline vf reduce_keys(const vf *s) {
    vf a[4], b[2];
    for (int i = 0; i < 4; i++) a[i] = FOLD(s[2 * i], s[2 * i + 1], L1_LO, L1_HI);
    for (int i = 0; i < 2; i++) b[i] = FOLD(a[2 * i], a[2 * i + 1], L2_LO, L2_HI);
    return FOLD(b[0], b[1], L3_LO, L3_HI);
}
#endif

/* Row pointers of the (up to VL) tokens at positions [pos0, pos0 + cnt): any power-of-two block size
 * works, including pages shorter than a chunk. */
static inline const float *row_ptr(const float *cache, const int32_t *table, int pos, int bs_shift, int bs_mask,
                                   int64_t token_stride, int64_t block_stride, int64_t head_offset) {
    return cache + (int64_t)table[pos >> bs_shift] * block_stride + (int64_t)(pos & bs_mask) * token_stride +
           head_offset;
}

/* Also prefetches the rows of the next chunk (positions up to L): pages are scattered, so the hardware
 * prefetcher cannot run ahead across them, and a decode pass is bound by memory latency without it. */
static inline void chunk_rows(const float *cache, const int32_t *table, int pos0, int cnt, int L, int D,
                              int bs_shift, int bs_mask, int64_t token_stride, int64_t block_stride,
                              int64_t head_offset, const float **rows) {
    for (int t = 0; t < cnt; t++)
        rows[t] = row_ptr(cache, table, pos0 + t, bs_shift, bs_mask, token_stride, block_stride, head_offset);
    const int next = pos0 + VL, next_cnt = L - next < VL ? L - next : VL;
    for (int t = 0; t < next_cnt; t++) {
        const char *r = (const char *)row_ptr(cache, table, next + t, bs_shift, bs_mask, token_stride, block_stride,
                                              head_offset);
        for (int off = 0; off < D * 4; off += 64) __builtin_prefetch(r + off, 0, 3);
    }
}

/* One (sequence, KV head): its G query heads against the sequence's pages. Inlined with a literal D for
 * the common head sizes (D a multiple of VL), so the dot products and V updates unroll fully. */
static inline __attribute__((always_inline)) void decode_one(
    const float *restrict qb, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, int L, int G, const int D, int bs_shift, int64_t token_stride,
    int64_t block_stride, int64_t head_offset, float scale, float *restrict scores, int64_t score_stride,
    float *restrict acc, float *restrict ob) {
    const int bs_mask = (1 << bs_shift) - 1;
    const int NV = D / VL;
    const float *rows[VL];
    /* Pass 1: scores, VL keys at a time; keys past the end of the context contribute zero vectors
     * (their lanes are never read back). */
    for (int pos0 = 0; pos0 < L; pos0 += VL) {
        const int cnt = L - pos0 < VL ? L - pos0 : VL;
        chunk_rows(k_cache, table, pos0, cnt, L, D, bs_shift, bs_mask, token_stride, block_stride, head_offset, rows);
        for (int g = 0; g < G; g++) {
            const float *qg = qb + (int64_t)g * D;
            vf s[VL];
            for (int t = 0; t < VL; t++) {
                vf a = {0};
                if (t < cnt)
                    for (int c = 0; c < NV; c++) a += load(qg + c * VL) * load(rows[t] + c * VL);
                s[t] = a;
            }
            store(scores + (int64_t)g * score_stride + pos0, reduce_keys(s) * scale);
        }
    }
    /* Softmax per query head (left unnormalized; the output is divided by the sum at the end). */
    float inv[G];
    for (int g = 0; g < G; g++) {
        float *sg = scores + (int64_t)g * score_stride;
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
        inv[g] = 1.f / sum;
    }
    /* Pass 2: weighted sum of V, chunk by chunk so the chunk's V rows are reused from L1 by every
     * query head of the group. */
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int pos0 = 0; pos0 < L; pos0 += VL) {
        const int cnt = L - pos0 < VL ? L - pos0 : VL;
        chunk_rows(v_cache, table, pos0, cnt, L, D, bs_shift, bs_mask, token_stride, block_stride, head_offset, rows);
        for (int g = 0; g < G; g++) {
            const float *pg = scores + (int64_t)g * score_stride + pos0;
            float *ag = acc + (int64_t)g * D;
            vf a[NV];
            for (int c = 0; c < NV; c++) a[c] = load(ag + c * VL);
            for (int t = 0; t < cnt; t++) {
                const float p = pg[t];
                for (int c = 0; c < NV; c++) a[c] += p * load(rows[t] + c * VL);
            }
            for (int c = 0; c < NV; c++) store(ag + c * VL, a[c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) ob[(int64_t)g * D + d] = acc[(int64_t)g * D + d] * inv[g];
}

/* Head sizes that are not a multiple of VL: the plain per-key loop (correct, not tuned). */
static void decode_one_generic(const float *restrict qb, const float *restrict k_cache,
                               const float *restrict v_cache, const int32_t *restrict table, int L, int G,
                               int D, int bs_shift, int64_t token_stride, int64_t block_stride,
                               int64_t head_offset, float scale, float *restrict scores, int64_t score_stride,
                               float *restrict acc, float *restrict ob) {
    const int bs_mask = (1 << bs_shift) - 1;
    for (int pos = 0; pos < L; pos++) {
        const float *kp = k_cache + (int64_t)table[pos >> bs_shift] * block_stride +
                          (int64_t)(pos & bs_mask) * token_stride + head_offset;
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int d = 0; d < D; d++) s += qb[(int64_t)g * D + d] * kp[d];
            scores[(int64_t)g * score_stride + pos] = s * scale;
        }
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int g = 0; g < G; g++) {
        float *sg = scores + (int64_t)g * score_stride;
        float m = sg[0], sum = 0.f;
        for (int pos = 1; pos < L; pos++) m = sg[pos] > m ? sg[pos] : m;
        for (int pos = 0; pos < L; pos++) {
            const float e = softmax_exp(sg[pos] - m);
            const float *vp = v_cache + (int64_t)table[pos >> bs_shift] * block_stride +
                              (int64_t)(pos & bs_mask) * token_stride + head_offset;
            for (int d = 0; d < D; d++) acc[(int64_t)g * D + d] += e * vp[d];
            sum += e;
        }
        for (int d = 0; d < D; d++) ob[(int64_t)g * D + d] = acc[(int64_t)g * D + d] / sum;
    }
}

int kvf_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                         float *out, int B, int H, int KVH, int D, int block_size, float scale,
                         int max_seq_len, int num_threads) {
    const int G = H / KVH;
    const int64_t token_stride = (int64_t)KVH * D;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    int bs_shift = 0;
    while ((1 << bs_shift) < block_size) bs_shift++;
    if ((1 << bs_shift) != block_size) return -2; /* the engine only allows powers of two */
    /* Score rows padded to whole chunks: pass 1 stores full vectors. */
    const int64_t score_stride = ((int64_t)(max_seq_len > 0 ? max_seq_len : 1) + VL - 1) / VL * VL;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        /* Per thread: scores [G, score_stride] and the output accumulators [G, D]. */
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)score_stride);
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
                decode_one(qb, k_cache, v_cache, table, L, G, 64, bs_shift, token_stride, block_stride, off,
                           scale, scores, score_stride, acc, ob);
            } else if (D == 128) {
                decode_one(qb, k_cache, v_cache, table, L, G, 128, bs_shift, token_stride, block_stride, off,
                           scale, scores, score_stride, acc, ob);
            } else if (D % VL == 0) {
                decode_one(qb, k_cache, v_cache, table, L, G, D, bs_shift, token_stride, block_stride, off,
                           scale, scores, score_stride, acc, ob);
            } else {
                decode_one_generic(qb, k_cache, v_cache, table, L, G, D, bs_shift, token_stride, block_stride,
                                   off, scale, scores, score_stride, acc, ob);
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
