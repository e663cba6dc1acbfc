/* The routed experts on FP4 records in host memory (kernels/cpu/moe.py builds and calls it; its torch reference is
 * kernels/moe/ref.py's moe_ref):
 *
 *     y[t] += w * W2 (silu(W1 x[t]) * (W3 x[t]))      for each (token t, weight w) routed to the record
 *
 * Records are read in place (layout/record.py): w13 [2I, D/2] and w2 [D, I/2] packed e2m1, the low nibble first;
 * one scale byte per block, decoded through `scale_of` (e4m3 for NVFP4, times its global scale; e8m0 for MXFP4).
 * Sums run in fp32. Threads split each matrix by rows, so no two threads write the same output. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Three paths, one result: AVX-512, AVX2 with FMA (most desktop CPUs), plain C (the compiler vectorizes its lanes);
 * DSFP4_PORTABLE forces plain C (the tests compare them) */
#if defined(__AVX512F__) && !defined(DSFP4_PORTABLE)
#define AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && !defined(DSFP4_PORTABLE)
#define AVX2 1
#include <immintrin.h>
#endif

#define ROWS 32  /* rows a thread takes at a time: a thread the OS parks holds up only its own */
#define TOKENS 8  /* tokens a decoded row serves before the next row is decoded: its codes are read once per 8 */
#define LANES 16  /* the plain path's lanes of a sum; every block is a multiple of 16 */

#ifdef AVX512
/* 16 codes (8 bytes, low nibble first) -> their values times s */
static inline __m512 decode16(const uint8_t *codes, __m512 lut, float s) {
    const __m128i low = _mm_set1_epi8(0x0f);
    __m128i c = _mm_loadl_epi64((const __m128i *)codes);
    __m128i pairs = _mm_unpacklo_epi8(_mm_and_si128(c, low), _mm_and_si128(_mm_srli_epi16(c, 4), low));
    return _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(pairs), lut), _mm512_set1_ps(s));
}
#elif defined(AVX2)
/* 8 codes (4 bytes, low nibble first) -> their values times s; the table holds the 8 magnitudes, bit 3 the sign */
static inline __m256 decode8(const uint8_t *codes, __m256 lut, float s) {
    const __m128i low = _mm_set1_epi8(0x0f);
    int32_t four;
    memcpy(&four, codes, sizeof four);
    __m128i c = _mm_cvtsi32_si128(four);
    __m256i idx = _mm256_cvtepu8_epi32(
        _mm_unpacklo_epi8(_mm_and_si128(c, low), _mm_and_si128(_mm_srli_epi16(c, 4), low)));
    __m256 v = _mm256_permutevar8x32_ps(lut, _mm256_and_si256(idx, _mm256_set1_epi32(7)));
    __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28));
    return _mm256_mul_ps(_mm256_xor_ps(v, sign), _mm256_set1_ps(s));
}

static inline float sum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
#endif

/* one row's dot product with up to TOKENS rows of xs (each of length k, ldx apart), the block scale folded into the
 * decoded weights. One token (a decode step) keeps four sums in flight, so that the adds do not wait on each other;
 * more tokens keep one each, added across lanes at the end */
static void row_dot(const uint8_t *codes, const uint8_t *scales, int k, int block, const float *e2m1,
                    const float *scale_of, float g, const float *xs, int ldx, int nt, float *out) {
#ifdef AVX512
    const __m512 lut = _mm512_loadu_ps(e2m1);
    const int groups = k / 16, shift = block == 32;  /* 16 values a group; a block is one group or two */
#define SCALE(i) (scale_of[scales[(i) >> shift]] * g)
    if (nt == 1) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int i = 0;
        for (; i + 4 <= groups; i += 4) {
            a0 = _mm512_fmadd_ps(decode16(codes + 8 * i, lut, SCALE(i)), _mm512_loadu_ps(xs + 16 * i), a0);
            a1 = _mm512_fmadd_ps(decode16(codes + 8 * i + 8, lut, SCALE(i + 1)), _mm512_loadu_ps(xs + 16 * i + 16), a1);
            a2 = _mm512_fmadd_ps(decode16(codes + 8 * i + 16, lut, SCALE(i + 2)), _mm512_loadu_ps(xs + 16 * i + 32), a2);
            a3 = _mm512_fmadd_ps(decode16(codes + 8 * i + 24, lut, SCALE(i + 3)), _mm512_loadu_ps(xs + 16 * i + 48), a3);
        }
        for (; i < groups; i++)
            a0 = _mm512_fmadd_ps(decode16(codes + 8 * i, lut, SCALE(i)), _mm512_loadu_ps(xs + 16 * i), a0);
        out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        return;
    }
    __m512 acc[TOKENS];
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int i = 0; i < groups; i++) {
        __m512 w = decode16(codes + 8 * i, lut, SCALE(i));
        for (int t = 0; t < nt; t++) acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xs + (size_t)t * ldx + 16 * i), acc[t]);
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
#undef SCALE
#elif defined(AVX2)
    const __m256 lut = _mm256_loadu_ps(e2m1);
    const int groups = k / 8, shift = block == 16 ? 1 : 2;  /* 8 values a group; a block is two groups or four */
#define SCALE(i) (scale_of[scales[(i) >> shift]] * g)
    if (nt == 1) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int i = 0;
        for (; i + 4 <= groups; i += 4) {
            a0 = _mm256_fmadd_ps(decode8(codes + 4 * i, lut, SCALE(i)), _mm256_loadu_ps(xs + 8 * i), a0);
            a1 = _mm256_fmadd_ps(decode8(codes + 4 * i + 4, lut, SCALE(i + 1)), _mm256_loadu_ps(xs + 8 * i + 8), a1);
            a2 = _mm256_fmadd_ps(decode8(codes + 4 * i + 8, lut, SCALE(i + 2)), _mm256_loadu_ps(xs + 8 * i + 16), a2);
            a3 = _mm256_fmadd_ps(decode8(codes + 4 * i + 12, lut, SCALE(i + 3)), _mm256_loadu_ps(xs + 8 * i + 24), a3);
        }
        for (; i < groups; i++)
            a0 = _mm256_fmadd_ps(decode8(codes + 4 * i, lut, SCALE(i)), _mm256_loadu_ps(xs + 8 * i), a0);
        out[0] = sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        return;
    }
    __m256 acc[TOKENS];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int i = 0; i < groups; i++) {
        __m256 w = decode8(codes + 4 * i, lut, SCALE(i));
        for (int t = 0; t < nt; t++) acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs + (size_t)t * ldx + 8 * i), acc[t]);
    }
    for (int t = 0; t < nt; t++) out[t] = sum8(acc[t]);
#undef SCALE
#else
    float acc[TOKENS][LANES] = {{0}};
    float w[LANES];
    for (int b = 0; b < k / block; b++) {
        float s = scale_of[scales[b]] * g;
        for (int j = 0; j < block; j += LANES) {
            const uint8_t *c = codes + (b * block + j) / 2;
            for (int l = 0; l < LANES / 2; l++) {
                w[2 * l] = e2m1[c[l] & 15] * s;
                w[2 * l + 1] = e2m1[c[l] >> 4] * s;
            }
            for (int t = 0; t < nt; t++) {
                const float *xb = xs + (size_t)t * ldx + b * block + j;
                for (int l = 0; l < LANES; l++) acc[t][l] += w[l] * xb[l];
            }
        }
    }
    for (int t = 0; t < nt; t++) {
        float sum = 0.0f;
        for (int l = 0; l < LANES; l++) sum += acc[t][l];
        out[t] = sum;
    }
#endif
}

/* rows [0, rows) of a matrix (k columns) times xs [nt, k] -> out [nt, rows] */
static void matvec(const uint8_t *codes, const uint8_t *scales, int rows, int k, int block, const float *e2m1,
                   const float *scale_of, float g, const float *xs, int nt, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(dynamic, ROWS)
    for (int r = 0; r < rows; r++) {
        float o[TOKENS];
        for (int t0 = 0; t0 < nt; t0 += TOKENS) {
            int n = nt - t0 < TOKENS ? nt - t0 : TOKENS;
            row_dot(codes + (size_t)r * (k / 2), scales + (size_t)r * (k / block), k, block, e2m1, scale_of, g,
                    xs + (size_t)t0 * k, k, n, o);
            for (int t = 0; t < n; t++) out[(size_t)(t0 + t) * rows + r] = o[t];
        }
    }
}

/* One expert for the nt tokens routed to it.
 * record: the record's first byte; offsets: byte offsets of w13, w13_scale, w2, w2_scale and scale_2 (-1: none);
 * xs: [nt, D] the tokens' inputs, gathered; rows: [nt] where each goes in y [*, D]; weights: [nt];
 * scratch: [nt, 2I + D] floats. */
void expert_ffn(const uint8_t *record, const int64_t *offsets, int dim, int inter, int block, const float *e2m1,
                const float *scale_of, float limit, const float *xs, int nt, const int64_t *rows,
                const float *weights, float *y, float *scratch, int threads) {
    const float *g = offsets[4] >= 0 ? (const float *)(record + offsets[4]) : NULL;
    const uint8_t *w13 = record + offsets[0], *s13 = record + offsets[1];
    float *gate = scratch, *up = scratch + (size_t)nt * inter, *out = scratch + (size_t)2 * nt * inter;
    /* gate rows [0, I) and up rows [I, 2I) have their own global scales under NVFP4 */
    matvec(w13, s13, inter, dim, block, e2m1, scale_of, g ? g[0] : 1.0f, xs, nt, gate, threads);
    matvec(w13 + (size_t)inter * (dim / 2), s13 + (size_t)inter * (dim / block), inter, dim, block, e2m1, scale_of,
           g ? g[1] : 1.0f, xs, nt, up, threads);
    for (size_t i = 0; i < (size_t)nt * inter; i++) {  /* gate becomes silu(gate) * up, clamped first by a limit */
        float a = gate[i], b = up[i];
        if (limit > 0) {
            a = a < limit ? a : limit;
            b = b < -limit ? -limit : (b > limit ? limit : b);
        }
        gate[i] = a / (1.0f + expf(-a)) * b;
    }
    matvec(record + offsets[2], record + offsets[3], dim, inter, block, e2m1, scale_of, g ? g[2] : 1.0f, gate, nt,
           out, threads);
    for (int t = 0; t < nt; t++) {
        float *yr = y + (size_t)rows[t] * dim;
        const float *o = out + (size_t)t * dim;
        for (int d = 0; d < dim; d++) yr[d] += weights[t] * o[d];
    }
}
