/* FP8 block-scaled linear on the host (kernels/cpu/fp8.py builds and calls it; its torch reference is
 * kernels/linear.py's linear_ref, which dequantizes with layout/fp8.py):
 *
 *     y[t, n] = sum_k x[t, k] * q[n, k] * scale[n / 128, k / 128]
 *
 * q: e4m3 bytes [N, K], scale: fp32 [ceil(N / 128), ceil(K / 128)] (ragged edges allowed). An e4m3 byte's bits,
 * shifted into a half's, are the half 2^-8 times its value (subnormals too), so the vector paths decode 16 or 8 bytes
 * with one conversion; the plain path looks them up in `e4m3` (256 values). Sums run in fp32. Threads split the
 * rows. (The vector paths read e4m3's NaN code as 480; the converter never stores NaN.) */
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__F16C__) && !defined(DSFP4_PORTABLE)
#define AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(DSFP4_PORTABLE)
#define AVX2 1
#include <immintrin.h>
#endif

#define BLOCK 128 /* the scale block, both ways */
#define ROWS 8    /* rows a thread takes at a time */
#define TOKENS 8  /* tokens a row serves before the next row is read */

#if defined(AVX512) || defined(AVX2)
/* e4m3 bits as a half's: sign to bit 15, exponent and mantissa to bits 13-7 (the half is 2^-8 times the value) */
static inline __m256i e4m3_halves16(__m128i b) {
    __m256i h = _mm256_cvtepu8_epi16(b);
    return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                           _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7));
}
#endif

/* one row against up to TOKENS rows of x (each k long, ldx apart) -> out[t] */
static void row_dot(const uint8_t *q, const float *scales, int k, const float *e4m3, const float *x, int ldx, int nt,
                    float *out) {
    float acc[TOKENS] = {0};
    for (int k0 = 0; k0 < k; k0 += BLOCK) {
        const int n = k - k0 < BLOCK ? k - k0 : BLOCK;
        const float s = scales[k0 / BLOCK];
        int j = 0;
#if defined(AVX512)
        const __m512 unit = _mm512_set1_ps(256.0f * s);
        __m512 v[TOKENS];
        for (int t = 0; t < nt; t++) v[t] = _mm512_setzero_ps();
        for (; j + 16 <= n; j += 16) {
            __m512 w = _mm512_mul_ps(
                _mm512_cvtph_ps(e4m3_halves16(_mm_loadu_si128((const __m128i *)(q + k0 + j)))), unit);
            for (int t = 0; t < nt; t++)
                v[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + (size_t)t * ldx + k0 + j), v[t]);
        }
        for (int t = 0; t < nt; t++) acc[t] += _mm512_reduce_add_ps(v[t]);
#elif defined(AVX2)
        const __m256 unit = _mm256_set1_ps(256.0f * s);
        __m256 v[TOKENS];
        for (int t = 0; t < nt; t++) v[t] = _mm256_setzero_ps();
        for (; j + 16 <= n; j += 16) {
            __m256i h = e4m3_halves16(_mm_loadu_si128((const __m128i *)(q + k0 + j)));
            __m256 w0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), unit);
            __m256 w1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), unit);
            for (int t = 0; t < nt; t++) {
                const float *xt = x + (size_t)t * ldx + k0 + j;
                v[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), v[t]));
            }
        }
        for (int t = 0; t < nt; t++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(v[t]), _mm256_extractf128_ps(v[t], 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            acc[t] += _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
        }
#endif
        for (; j < n; j++) { /* the plain path, and the vector paths' tail */
            const float w = e4m3[q[k0 + j]] * s;
            for (int t = 0; t < nt; t++) acc[t] += w * x[(size_t)t * ldx + k0 + j];
        }
    }
    for (int t = 0; t < nt; t++) out[t] = acc[t];
}

/* x: [nt, k] fp32, q: [n_rows, k] e4m3, scale: [ceil(n_rows / 128), ceil(k / 128)] -> y: [nt, n_rows] fp32 */
void fp8_linear(const uint8_t *q, const float *scale, int n_rows, int k, const float *e4m3, const float *x, int nt,
                float *y, int threads) {
    const int kb = (k + BLOCK - 1) / BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, ROWS)
    for (int r = 0; r < n_rows; r++) {
        float o[TOKENS];
        for (int t0 = 0; t0 < nt; t0 += TOKENS) {
            const int m = nt - t0 < TOKENS ? nt - t0 : TOKENS;
            row_dot(q + (size_t)r * k, scale + (size_t)(r / BLOCK) * kb, k, e4m3, x + (size_t)t0 * k, k, m, o);
            for (int t = 0; t < m; t++) y[(size_t)(t0 + t) * n_rows + r] = o[t];
        }
    }
}
