/* y = x @ W.T over 16-bit weights (bfloat16 or float16) kept as stored, in float32.
 *
 * Why: a decode step reads every weight once for a handful of rows, so it runs at the speed weights are
 * read. BLAS reads float32 (4 bytes a weight, and a resident float32 copy of the model); torch's own
 * bfloat16 matmul rounds the activations and the result to bfloat16. Here each weight is widened to float32
 * in registers (exact for both formats) and multiplied by the float32 row: the float32 arithmetic of a
 * float32 model over the same weights, 2 bytes a weight read.
 *
 * Contract:
 *   x  [rows, in_features] float32, rows x_stride floats apart, each row contiguous
 *   w  [out_features, in_features] uint16 (bfloat16 bits, or float16 bits with `half`), contiguous
 *   y  [rows, out_features] float32, contiguous
 * Each row accumulates alone, in a fixed order (64 lanes over k, lane j taking k = j mod 64, then the
 * lanes summed in one fixed tree, then the last in_features mod 64 products in order): a row's result does
 * not depend on how many rows share the call (batch invariance). Output features are split over threads:
 * `half_matmul` only where the product is large enough to repay waking the pool, `half_matmul_threads`
 * always (the decoder layer's back-to-back calls, which find the pool awake: decoder_layer.c).
 */
#include <stdint.h>
#include <string.h>

#define LANES 16
#define CHAINS 4 /* independent sums a row keeps: one would wait on the multiply-add's latency */
#define BODY (LANES * CHAINS)
#define ROW_TILE 4
/* Below this many multiply-adds one thread does the call, as packed_matmul.c: waking the pool costs more. */
#define PARALLEL_WORK (4L << 20)

static inline float widen(uint16_t bits, int half) {
    if (!half) {
        uint32_t u = (uint32_t)bits << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    uint32_t sign = (uint32_t)(bits & 0x8000) << 16, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
    uint32_t u;
    if (exponent == 0x1f) {
        u = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) { /* subnormal: normalize */
        int shift = 0;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            shift++;
        }
        u = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>

static inline __m512 widen16(const uint16_t *w, int half) {
    __m256i bits = _mm256_loadu_si256((const __m256i *)w);
    if (half) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* Up to ROW_TILE rows against one weight row: sums[r] gets row r's BODY lanes summed. */
static void tile(const float *x, int64_t x_stride, int rows, const uint16_t *w, int64_t in_features, int half,
                 float *sums) {
    __m512 acc[ROW_TILE][CHAINS];
    for (int r = 0; r < ROW_TILE; r++)
        for (int c = 0; c < CHAINS; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t body = in_features - in_features % BODY;
    for (int64_t k = 0; k < body; k += BODY) {
        for (int c = 0; c < CHAINS; c++) {
            __m512 wk = widen16(w + k + c * LANES, half);
            for (int r = 0; r < rows; r++)
                acc[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * x_stride + k + c * LANES), wk, acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m512 total = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
        sums[r] = _mm512_reduce_add_ps(total);
    }
}
#else
static void tile(const float *x, int64_t x_stride, int rows, const uint16_t *w, int64_t in_features, int half,
                 float *sums) {
    float acc[ROW_TILE][BODY] = {{0}};
    int64_t body = in_features - in_features % BODY;
    for (int64_t k = 0; k < body; k += BODY) {
        float wk[BODY];
        for (int j = 0; j < BODY; j++) wk[j] = widen(w[k + j], half);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < BODY; j++) acc[r][j] += x[r * x_stride + k + j] * wk[j];
    }
    for (int r = 0; r < rows; r++) {
        float s = 0;
        for (int j = 0; j < BODY; j++) s += acc[r][j];
        sums[r] = s;
    }
}
#endif

void half_matmul_threads(const float *x, int64_t x_stride, int64_t rows, const uint16_t *w, int64_t in_features,
                         int64_t out_features, int half, float *y, int num_threads) {
    int64_t body = in_features - in_features % BODY;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < out_features; n++) {
        const uint16_t *wn = w + n * in_features;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            int count = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            float sums[ROW_TILE];
            tile(x + r0 * x_stride, x_stride, count, wn, in_features, half, sums);
            for (int r = 0; r < count; r++) {
                const float *xr = x + (r0 + r) * x_stride;
                float s = sums[r];
                for (int64_t k = body; k < in_features; k++) s += xr[k] * widen(wn[k], half);
                y[(r0 + r) * out_features + n] = s;
            }
        }
    }
}

void half_matmul(const float *x, int64_t x_stride, int64_t rows, const uint16_t *w, int64_t in_features,
                 int64_t out_features, int half, float *y, int num_threads) {
    const int parallel = rows * in_features * out_features >= PARALLEL_WORK;
    half_matmul_threads(x, x_stride, rows, w, in_features, out_features, half, y, parallel ? num_threads : 1);
}
