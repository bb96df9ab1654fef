/* y = x @ W.T over 16-bit weights (bfloat16 or float16) kept as stored, in float32; or, for bfloat16
 * weights, over the rows rounded to bfloat16 (bfloat16 products, float32 sums: AVX512-BF16's vdpbf16ps).
 *
 * Why: BLAS reads float32 (4 bytes a weight, and a resident float32 copy of the model); torch's own
 * bfloat16 matmul rounds the activations and the result to bfloat16. Here each weight is widened to float32
 * in registers (exact for both formats) and multiplied by the float32 row: the float32 arithmetic of a
 * float32 model over the same weights, 2 bytes a weight read. The weights are laid out in panels of 16
 * output features, k-major, so that one vector of weights serves every row of a tile: a prefill tile of 6
 * rows x 64 outputs does 24 multiply-adds for 4 weight vectors and 6 broadcasts (a GEMM's register
 * blocking), where a dot-product layout does about one load a multiply-add. The pairs kernel keeps that
 * blocking with two k a lane: vdpbf16ps does twice the multiply-adds of an FMA in the same time, the only
 * rounding being the rows' to bfloat16 (a bfloat16 product is exact in float32).
 *
 * Contract:
 *   x  [rows, in_features] float32, rows x_stride floats apart, each row contiguous
 *   w  half_matmul: [ceil(out_features / 16), in_features, 16] uint16 (bfloat16 bits, or float16 bits
 *      with `half`), contiguous: panel p, line k holds W[16p + j, k] at j (0 past out_features)
 *      half_matmul_pairs: [ceil(out_features / 16), ceil(in_features / 2), 16, 2] bfloat16 bits: panel p,
 *      line q holds W[16p + j, 2q + i] at (j, i) (0 past out_features and in_features)
 *   y  [rows, out_features] float32, contiguous
 * Each output accumulates alone, in increasing k from 0 (one fused multiply-add per k; with pairs, one
 * vdpbf16ps per two k): a row's result does not depend on how many rows share the call, nor on the tiling or
 * the threads; half_matmul's AVX-512, AVX2 and plain C paths (fmaf) give the same bits. Work is split over
 * threads: `half_matmul` / `half_matmul_pairs` only where the product is large enough to repay waking the
 * pool, the `_threads` forms always (the decoder layer's back-to-back calls, which find the pool awake:
 * decoder_layer.c). The pairs forms return 0, or 2 where the rows' bfloat16 copy cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16
#define ROW_TILE 6
#define PANEL_TILE 4
#define ROW_BLOCK (4 * ROW_TILE) /* rows of one unit of threaded work */
/* Below this many multiply-adds one thread does the call, as packed_matmul.c: waking the pool costs more. */
#define PARALLEL_WORK (4L << 20)
#define NO_MEMORY 2 /* as packed_matmul.c's KVF_NO_MEMORY */
#define INLINE static inline __attribute__((always_inline))

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

/* Where output column n0 + j of a panel is past out_features, nothing is stored. */
static inline int columns(int64_t n0, int64_t out_features) {
    return out_features - n0 < PANEL ? (int)(out_features - n0) : PANEL;
}

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>

INLINE __m512 widen16(const uint16_t *w, const int half) {
    __m256i bits = _mm256_loadu_si256((const __m256i *)w);
    if (half) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* R rows x NP panels (R, NP, half constant where it is inlined: the accumulators stay in registers). */
INLINE void tile(const float *x, int64_t x_stride, const uint16_t *w, int64_t in_features, float *y,
                 int64_t out_features, int64_t n0, const int R, const int NP, const int half) {
    __m512 acc[ROW_TILE][PANEL_TILE];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < NP; p++) acc[r][p] = _mm512_setzero_ps();
    const int64_t panel_stride = in_features * PANEL;
    for (int64_t k = 0; k < in_features; k++) {
        __m512 wk[PANEL_TILE];
        for (int p = 0; p < NP; p++) wk[p] = widen16(w + p * panel_stride + k * PANEL, half);
#pragma GCC unroll 6 /* the accumulators stay in registers only where every row's loop is unrolled */
        for (int r = 0; r < R; r++) {
            __m512 xk = _mm512_set1_ps(x[r * x_stride + k]);
            for (int p = 0; p < NP; p++) acc[r][p] = _mm512_fmadd_ps(xk, wk[p], acc[r][p]);
        }
    }
    for (int p = 0; p < NP; p++) {
        int64_t n = n0 + p * PANEL;
        __mmask16 mask = (__mmask16)((1u << columns(n, out_features)) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * out_features + n, mask, acc[r][p]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

INLINE __m256 widen8(const uint16_t *w, const int half) {
    __m128i bits = _mm_loadu_si128((const __m128i *)w);
    if (half) return _mm256_cvtph_ps(bits);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/* AVX2 has 16 registers: R rows x one panel (two vectors) at a time, the same operations per output. */
INLINE void tile(const float *x, int64_t x_stride, const uint16_t *w, int64_t in_features, float *y,
                 int64_t out_features, int64_t n0, const int R, const int NP, const int half) {
    for (int p = 0; p < NP; p++) {
        const uint16_t *wp = w + p * in_features * PANEL;
        __m256 acc[ROW_TILE][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t k = 0; k < in_features; k++) {
            __m256 lo = widen8(wp + k * PANEL, half), hi = widen8(wp + k * PANEL + 8, half);
#pragma GCC unroll 6 /* as above */
            for (int r = 0; r < R; r++) {
                __m256 xk = _mm256_broadcast_ss(x + r * x_stride + k);
                acc[r][0] = _mm256_fmadd_ps(xk, lo, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(xk, hi, acc[r][1]);
            }
        }
        int64_t n = n0 + p * PANEL;
        for (int r = 0; r < R; r++) {
            float out[PANEL];
            _mm256_storeu_ps(out, acc[r][0]);
            _mm256_storeu_ps(out + 8, acc[r][1]);
            memcpy(y + r * out_features + n, out, columns(n, out_features) * sizeof(float));
        }
    }
}
#else
INLINE void tile(const float *x, int64_t x_stride, const uint16_t *w, int64_t in_features, float *y,
                 int64_t out_features, int64_t n0, const int R, const int NP, const int half) {
    float acc[ROW_TILE][PANEL_TILE * PANEL] = {{0}};
    const int64_t panel_stride = in_features * PANEL;
    for (int64_t k = 0; k < in_features; k++) {
        float wk[PANEL_TILE * PANEL];
        for (int p = 0; p < NP; p++)
            for (int j = 0; j < PANEL; j++) wk[p * PANEL + j] = widen(w[p * panel_stride + k * PANEL + j], half);
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NP * PANEL; j++) acc[r][j] = fmaf(x[r * x_stride + k], wk[j], acc[r][j]);
    }
    for (int p = 0; p < NP; p++) {
        int64_t n = n0 + p * PANEL;
        for (int r = 0; r < R; r++) memcpy(y + r * out_features + n, acc[r] + p * PANEL, columns(n, out_features) * sizeof(float));
    }
}
#endif

#define TILE(R, NP)                                                                                            \
    case (R - 1) * PANEL_TILE + NP - 1:                                                                        \
        if (half)                                                                                              \
            tile(x, x_stride, w, in_features, y, out_features, n0, R, NP, 1);                                  \
        else                                                                                                   \
            tile(x, x_stride, w, in_features, y, out_features, n0, R, NP, 0);                                  \
        break;
#define TILES(R) TILE(R, 1) TILE(R, 2) TILE(R, 3) TILE(R, 4)

/* `rows` (1..ROW_TILE) rows x `panels` (1..PANEL_TILE) panels from output column n0. */
static void any_tile(const float *x, int64_t x_stride, int rows, const uint16_t *w, int panels,
                     int64_t in_features, int half, float *y, int64_t out_features, int64_t n0) {
    switch ((rows - 1) * PANEL_TILE + panels - 1) {
        TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
    }
}

/* The threaded split: units of (panel group, block of rows), group-major, so that a thread's consecutive
 * units share weights; a unit runs tiles of up to ROW_TILE rows over its up to PANEL_TILE panels. */
typedef struct {
    int64_t panels, blocks, units;
} split;

typedef struct {
    int64_t p0, r0, r1; /* its first panel, its rows [r0, r1) */
    int np;             /* its panels */
} unit_span;

static split split_of(int64_t rows, int64_t out_features) {
    const int64_t panels = (out_features + PANEL - 1) / PANEL, blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    return (split){panels, blocks, (panels + PANEL_TILE - 1) / PANEL_TILE * blocks};
}

static unit_span unit_of(const split *s, int64_t unit, int64_t rows) {
    const int64_t p0 = unit / s->blocks * PANEL_TILE, b = unit % s->blocks;
    const int64_t r1 = (b + 1) * ROW_BLOCK < rows ? (b + 1) * ROW_BLOCK : rows;
    return (unit_span){p0, b * ROW_BLOCK, r1, s->panels - p0 < PANEL_TILE ? (int)(s->panels - p0) : PANEL_TILE};
}

static inline int tile_rows(int64_t r0, int64_t r1) { return r1 - r0 < ROW_TILE ? (int)(r1 - r0) : ROW_TILE; }

void half_matmul_threads(const float *x, int64_t x_stride, int64_t rows, const uint16_t *w, int64_t in_features,
                         int64_t out_features, int half, float *y, int num_threads) {
    const split s = split_of(rows, out_features);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t unit = 0; unit < s.units; unit++) {
        const unit_span u = unit_of(&s, unit, rows);
        for (int64_t r0 = u.r0; r0 < u.r1; r0 += ROW_TILE)
            any_tile(x + r0 * x_stride, x_stride, tile_rows(r0, u.r1), w + u.p0 * in_features * PANEL, u.np,
                     in_features, half, y + r0 * out_features, out_features, u.p0 * PANEL);
    }
}

void half_matmul(const float *x, int64_t x_stride, int64_t rows, const uint16_t *w, int64_t in_features,
                 int64_t out_features, int half, float *y, int num_threads) {
    const int parallel = rows * in_features * out_features >= PARALLEL_WORK;
    half_matmul_threads(x, x_stride, rows, w, in_features, out_features, half, y, parallel ? num_threads : 1);
}

/* ---- bfloat16 rows times bfloat16 weights, two k a lane ---- */

/* The nearest bfloat16 (ties to even; a NaN stays a quiet NaN), denormals as 0: what vdpbf16ps does with
 * a denormal input, so that the vector and plain C paths multiply the same rows. (They part only where a
 * weight is denormal or a sum underflows: the instruction flushes those, plain C does not.) */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* One row of x rounded into out, zero past in_features: pair q is out[2q], out[2q + 1]. */
static void round_row(const float *x, int64_t in_features, int64_t pairs, uint16_t *out) {
#pragma omp simd
    for (int64_t k = 0; k < in_features; k++) out[k] = to_bf16(x[k]);
    if (in_features < 2 * pairs) out[in_features] = 0;
}

#if defined(__AVX512BF16__)
/* R rows x NP panels, as tile() above, one vdpbf16ps per two k. */
INLINE void pair_tile(const uint16_t *xq, int64_t pairs, const uint16_t *w, float *y, int64_t out_features,
                      int64_t n0, const int R, const int NP) {
    __m512 acc[ROW_TILE][PANEL_TILE];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < NP; p++) acc[r][p] = _mm512_setzero_ps();
    const int64_t panel_stride = pairs * 2 * PANEL;
    for (int64_t q = 0; q < pairs; q++) {
        __m512bh wq[PANEL_TILE];
        for (int p = 0; p < NP; p++) wq[p] = (__m512bh)_mm512_loadu_si512(w + p * panel_stride + q * 2 * PANEL);
#pragma GCC unroll 6 /* as tile()'s */
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, xq + 2 * (r * pairs + q), sizeof pair);
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            for (int p = 0; p < NP; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xr, wq[p]);
        }
    }
    for (int p = 0; p < NP; p++) {
        int64_t n = n0 + p * PANEL;
        __mmask16 mask = (__mmask16)((1u << columns(n, out_features)) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * out_features + n, mask, acc[r][p]);
    }
}
#else
/* vdpbf16ps's order in plain C: per lane, the odd k's product added, then the even k's (each exact). */
INLINE void pair_tile(const uint16_t *xq, int64_t pairs, const uint16_t *w, float *y, int64_t out_features,
                      int64_t n0, const int R, const int NP) {
    const int64_t panel_stride = pairs * 2 * PANEL;
    for (int p = 0; p < NP; p++) {
        const int64_t n = n0 + p * PANEL;
        for (int r = 0; r < R; r++)
            for (int j = 0; j < columns(n, out_features); j++) {
                float acc = 0.f;
                for (int64_t q = 0; q < pairs; q++) {
                    const uint16_t *wq = w + p * panel_stride + q * 2 * PANEL + 2 * j;
                    /* One 32-bit read, as the vector path's: read as two uint16_t, GCC 12's -O3 vectorizer
                     * summed this loop wrong (a one-hot row's even k counted twice; -O2 was right). */
                    uint32_t pair;
                    memcpy(&pair, xq + 2 * (r * pairs + q), sizeof pair);
                    acc += widen((uint16_t)(pair >> 16), 0) * widen(wq[1], 0);
                    acc += widen((uint16_t)pair, 0) * widen(wq[0], 0);
                }
                y[r * out_features + n + j] = acc;
            }
    }
}
#endif

#define PAIR_TILE(R, NP)                                                                                       \
    case (R - 1) * PANEL_TILE + NP - 1:                                                                        \
        pair_tile(xq, pairs, w, y, out_features, n0, R, NP);                                                   \
        break;
#define PAIR_TILES(R) PAIR_TILE(R, 1) PAIR_TILE(R, 2) PAIR_TILE(R, 3) PAIR_TILE(R, 4)

static void any_pair_tile(const uint16_t *xq, int64_t pairs, int rows, const uint16_t *w, int panels, float *y,
                          int64_t out_features, int64_t n0) {
    switch ((rows - 1) * PANEL_TILE + panels - 1) {
        PAIR_TILES(1) PAIR_TILES(2) PAIR_TILES(3) PAIR_TILES(4) PAIR_TILES(5) PAIR_TILES(6)
    }
}

int half_matmul_pairs_threads(const float *x, int64_t x_stride, int64_t rows, const uint16_t *w,
                              int64_t in_features, int64_t out_features, float *y, int num_threads) {
    const int64_t pairs = (in_features + 1) / 2;
    const split s = split_of(rows, out_features);
    uint16_t *xq = malloc(2 * sizeof(uint16_t) * (size_t)(rows * pairs));
    if (xq == NULL) return NO_MEMORY;
    /* One team for both loops: each row rounded once (alone: the same bits whichever thread does it), and
     * the barrier between the loops hands every unit all of them. */
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) round_row(x + r * x_stride, in_features, pairs, xq + 2 * r * pairs);
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < s.units; unit++) {
            const unit_span u = unit_of(&s, unit, rows);
            for (int64_t r0 = u.r0; r0 < u.r1; r0 += ROW_TILE)
                any_pair_tile(xq + 2 * r0 * pairs, pairs, tile_rows(r0, u.r1), w + u.p0 * pairs * 2 * PANEL, u.np,
                              y + r0 * out_features, out_features, u.p0 * PANEL);
        }
    }
    free(xq);
    return 0;
}

int half_matmul_pairs(const float *x, int64_t x_stride, int64_t rows, const uint16_t *w, int64_t in_features,
                      int64_t out_features, float *y, int num_threads) {
    const int parallel = rows * in_features * out_features >= PARALLEL_WORK;
    return half_matmul_pairs_threads(x, x_stride, rows, w, in_features, out_features, y, parallel ? num_threads : 1);
}
