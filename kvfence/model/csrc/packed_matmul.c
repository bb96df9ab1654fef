/* y = x @ W.T for a few rows (decode), straight from the GGUF's quantized weights, in float32.
 *
 * Why: a decode step multiplies a handful of rows by every weight of the model, so it is bound by
 * reading weights, and BLAS reads them as float32, 4 bytes each. The GGUF stores them as 4- or 8-bit
 * codes with a float scale (and offset) per block of 32; each weight is exactly
 * code * scale + offset in float32 (the product is exact, one rounding in the add), the very value
 * the loader hands BLAS. Reading the codes (widened to one byte) and scales costs 1.25 bytes per
 * weight, and dequantizing in registers with one fused multiply-add gives the same weights.
 *
 * Contract (packed once at load by packed_matmul.py):
 *   codes    [panels, in_features, PANEL] int8: output features in panels of PANEL columns
 *   scales   [panels, in_features / group, PANEL] float32; offsets likewise (group: 32, or 16 for Q6_K)
 *   x        [rows, in_features], rows x_stride floats apart
 *   y        [rows, panels * PANEL], contiguous
 * Each row accumulates alone, over k in order (a partial sum per group, added to the row's total),
 * with fused multiply-adds, whatever tile it lands in: a row's result does not depend on how many rows
 * share the call (batch invariance). The AVX-512 path and
 * the portable one (KVF_PORTABLE, or any other CPU) perform the same operations and give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define KVF_OK 0
#define KVF_NO_MEMORY 2

#define PANEL 32 /* output columns per panel: two 16-float vectors */
#define MAX_TILE 8
#ifndef KVF_PARALLEL_WORK
#define KVF_PARALLEL_WORK (4L << 20) /* multiply-adds below which one thread does a product alone */
#endif

#if defined(__AVX512F__) && !defined(KVF_PORTABLE)
#include <immintrin.h>
typedef __m512 vec;
static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vec_store(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_broadcast(float x) { return _mm512_set1_ps(x); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vec_codes(const int8_t *c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
}
#else
typedef struct {
    float lane[16];
} vec;
static inline vec vec_load(const float *p) {
    vec v;
    for (int j = 0; j < 16; j++) v.lane[j] = p[j];
    return v;
}
static inline void vec_store(float *p, vec v) {
    for (int j = 0; j < 16; j++) p[j] = v.lane[j];
}
static inline vec vec_zero(void) { return (vec){{0}}; }
static inline vec vec_broadcast(float x) {
    vec v;
    for (int j = 0; j < 16; j++) v.lane[j] = x;
    return v;
}
static inline vec vec_fma(vec a, vec b, vec c) {
    for (int j = 0; j < 16; j++) c.lane[j] = fmaf(a.lane[j], b.lane[j], c.lane[j]);
    return c;
}
static inline vec vec_add(vec a, vec b) {
    for (int j = 0; j < 16; j++) a.lane[j] += b.lane[j];
    return a;
}
static inline vec vec_codes(const int8_t *c) {
    vec v;
    for (int j = 0; j < 16; j++) v.lane[j] = (float)c[j];
    return v;
}
#endif

/* `rows` (<= MAX_TILE) rows times one panel. xt holds the tile's rows transposed, [in_features][rows], so
 * that one pointer serves every broadcast. Two weight vectors per broadcast: with one, the broadcasts
 * (one load each) and not the multiply-adds limit the loop (measured: 1.9 vs 3.7 G multiply-adds/s).
 * Each block of 32 products is summed on its own and then added to the total: one running sum over all
 * of in_features drifted up to 2.3e-4 from float64 in SmolLM2's logits, per block 5.1e-5 (BLAS: 5.5e-5). */
static inline __attribute__((always_inline)) void tile(const int rows, const float *xt, const int8_t *codes,
                                                       const float *scales, const float *offsets,
                                                       int64_t in_features, int64_t group, float *y,
                                                       int64_t y_stride) {
    vec total[MAX_TILE][2], acc[MAX_TILE][2];
    for (int m = 0; m < rows; m++) total[m][0] = total[m][1] = vec_zero();
    for (int64_t b = 0; b < in_features / group; b++) {
        const float *s = scales + b * PANEL, *o = offsets + b * PANEL;
        const vec s0 = vec_load(s), s1 = vec_load(s + 16), o0 = vec_load(o), o1 = vec_load(o + 16);
        for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = vec_zero();
        for (int64_t k = b * group; k < (b + 1) * group; k++) {
            const vec w0 = vec_fma(vec_codes(codes + k * PANEL), s0, o0);
            const vec w1 = vec_fma(vec_codes(codes + k * PANEL + 16), s1, o1);
#pragma GCC unroll 8
            for (int m = 0; m < rows; m++) {
                const vec xb = vec_broadcast(xt[k * rows + m]);
                acc[m][0] = vec_fma(xb, w0, acc[m][0]);
                acc[m][1] = vec_fma(xb, w1, acc[m][1]);
            }
        }
        for (int m = 0; m < rows; m++) {
            total[m][0] = vec_add(total[m][0], acc[m][0]);
            total[m][1] = vec_add(total[m][1], acc[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) {
        vec_store(y + m * y_stride, total[m][0]);
        vec_store(y + m * y_stride + 16, total[m][1]);
    }
}

typedef void (*tile_fn)(const float *, const int8_t *, const float *, const float *, int64_t, int64_t, float *,
                        int64_t);
#define TILE(ROWS)                                                                                        \
    static void tile_##ROWS(const float *xt, const int8_t *codes, const float *scales, const float *offsets, \
                            int64_t in_features, int64_t group, float *y, int64_t y_stride) {             \
        tile(ROWS, xt, codes, scales, offsets, in_features, group, y, y_stride);                          \
    }
TILE(8)
TILE(4)
TILE(2)
TILE(1)

/* Rows are cut into tiles of 8, then one each of 4, 2 and 1 as needed. */
static int tile_rows(int64_t remaining) {
    return remaining >= 8 ? 8 : remaining >= 4 ? 4 : remaining >= 2 ? 2 : 1;
}

static tile_fn tile_for(int rows) { return rows == 8 ? tile_8 : rows == 4 ? tile_4 : rows == 2 ? tile_2 : tile_1; }

int packed_matmul(const float *x, int64_t x_stride, int64_t rows, const int8_t *codes, const float *scales,
                  const float *offsets, int64_t in_features, int64_t group, int64_t panels, float *y,
                  int num_threads) {
    const int64_t out_features = panels * PANEL, blocks = in_features / group;
    float *xt = malloc(sizeof(float) * rows * in_features);
    if (xt == NULL) return KVF_NO_MEMORY;
    for (int64_t first = 0; first < rows; first += tile_rows(rows - first)) {
        const int n = tile_rows(rows - first);
        for (int i = 0; i < n; i++)
            for (int64_t k = 0; k < in_features; k++)
                xt[first * in_features + k * n + i] = x[(first + i) * x_stride + k];
    }
    /* Threads only where each gets enough to do: a small product (one decode row of a small model's
     * projection) finishes in the time a second thread takes to join, and on a machine with as many
     * threads as cores a thread the kernel preempts stalls the others at the join. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * in_features * out_features >= KVF_PARALLEL_WORK)
    for (int64_t p = 0; p < panels; p++) {
        const int8_t *c = codes + p * in_features * PANEL;
        const float *s = scales + p * blocks * PANEL, *o = offsets + p * blocks * PANEL;
        for (int64_t first = 0; first < rows; first += tile_rows(rows - first))
            tile_for(tile_rows(rows - first))(xt + first * in_features, c, s, o, in_features, group,
                                              y + first * out_features + p * PANEL, out_features);
    }
    free(xt);
    return KVF_OK;
}
