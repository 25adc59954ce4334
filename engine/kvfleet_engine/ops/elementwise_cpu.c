/*
 * Fused elementwise kernels for CPUs (float32), each one pass over its rows where the torch
 * expressions take five to ten (every torch op reads and writes the whole tensor and allocates its
 * result, and at decode batch sizes the per-op dispatch costs as much as the arithmetic).
 *
 * Arithmetic follows the torch/HF expressions it replaces, in float32: RMSNorm is
 * w * (x * 1 / sqrt(mean(x^2) + eps)); rotary is x * cos + rotate_half(x) * sin. Only summation
 * order and fused multiply-adds differ, i.e. rounding at the 1e-7 relative level.
 *
 * Rows are independent; large batches (prefill) split rows over threads, small ones stay on the
 * calling thread (a parallel region's barrier would cost more than the work).
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_ELEMS (1 << 16)

/* out[t] = weight * norm(x[t] (+ residual[t])); with a residual, res_out[t] = x[t] + residual[t]. */
static inline void rmsnorm_row(const float *restrict x, const float *restrict res, const float *restrict w,
                               float eps, int n, float *restrict out, float *restrict res_out) {
    float ss = 0.f;
    if (res) {
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; i++) {
            const float h = x[i] + res[i];
            res_out[i] = h;
            ss += h * h;
        }
        x = res_out;
    } else {
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; i++) ss += x[i] * x[i];
    }
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

/* x, res, out, res_out: [T, n] with row strides (elements); res and res_out may be NULL (no residual). */
void kvf_rmsnorm_f32(const float *x, int64_t x_stride, const float *res, int64_t res_stride, const float *w,
                     float eps, int64_t T, int n, float *out, float *res_out, int num_threads) {
    const int threads = (T * n >= PARALLEL_MIN_ELEMS) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < T; t++)
        rmsnorm_row(x + t * x_stride, res ? res + t * res_stride : 0, w, eps, n, out + t * n,
                    res ? res_out + t * n : 0);
}

/* In place, on the first num_heads heads of each row (q heads then k heads, as the fused qkv
 * projection lays them out): x[:half] <- x[:half] cos - x[half:] sin, x[half:] <- x[half:] cos + x[:half] sin.
 * cos_sin: [max_position, D] tables (each half repeated, as the torch path builds them). */
void kvf_rotary_f32(float *x, int64_t row_stride, int64_t T, int num_heads, int D, const int64_t *positions,
                    const float *cos_table, const float *sin_table, int num_threads) {
    const int half = D / 2;
    const int threads = (T * num_heads * D >= PARALLEL_MIN_ELEMS) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * D;
        const float *s = sin_table + positions[t] * D;
        for (int h = 0; h < num_heads; h++) {
            float *restrict a = x + t * row_stride + (int64_t)h * D;
            float *restrict b = a + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[half + i] + x1 * s[half + i];
            }
        }
    }
}
