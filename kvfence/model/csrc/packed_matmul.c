/* y = x @ W.T straight from the GGUF's quantized weights, in float32, for any number of rows.
 *
 * Why: a decode step multiplies a handful of rows by every weight of the model, so it is bound by
 * reading weights, and BLAS reads them as float32, 4 bytes each. The GGUF stores them as 4- to 8-bit
 * codes with a scale (and offset) per group; each weight is exactly code * scale + offset in float32
 * (the product is exact, one rounding in the add), the very value the reference dequantizer gives.
 * Codes that span at most 16 values (Q4_0, Q4_1, Q4_K) are kept as nibbles, others as bytes; scales
 * and offsets that float16 holds exactly (every non-K format's) as float16, others as float32: Q4_0 and
 * Q4_1 cost 0.625 bytes a weight, as in the file, Q8_0 1.0625 (no offsets: all are 0), Q4_K 0.75.
 *
 * Contract (packed once at load by packed_matmul.py; `format` says which storage):
 *   codes    [panels, in_features, PANEL] int8, or with KVF_NIBBLES [panels, in_features, PANEL / 2]
 *            uint8: byte j of a row holds column j in its low nibble and column j + 16 in its high one
 *   scales   [panels, in_features / group, PANEL] float32, or float16 with KVF_HALF; offsets likewise,
 *            or NULL where every offset is -8 x its scale (Q4_0's codes centred on 8: 10% fewer bytes),
 *            or, with KVF_ZERO_OFFSETS, NULL where every offset is 0 (signed codes: Q8_0, Q5_0, Q6_K),
 *            whose tiles leave the offset term out (group: 32, or 16 for Q6_K)
 *   x        [rows, in_features], rows x_stride floats apart
 *   y        [rows, panels * PANEL], contiguous
 * Each row accumulates alone, over k in order (a partial sum per group, added to the row's total),
 * with fused multiply-adds, whatever tile it lands in: a row's result does not depend on how many rows
 * share the call (batch invariance). The AVX-512 path, the AVX2 one (two vectors of 8 for each of 16) and
 * the portable one (KVF_PORTABLE, or any other CPU) perform the same operations and give the same bits.
 *
 * KVF_DOT (with KVF_NIBBLES, group 32): llama.cpp's method, integer dot products. Each row of x is
 * quantized per block of 32 to int8 (q = round(x / d), d = max|x| / 127), and a block's weights
 * w = c * s + o contribute d * (s * sum(c * q) + o * sum(q)): the integer sums are exact (VNNI's
 * vpdpbusd, AVX-512BW's or AVX2's vpmaddubsw + vpmaddwd, or plain C: the same integers), the float
 * epilogue is the same operations on every path, so the bits agree across paths and batch shapes as
 * above; the results differ from the float path by the activations' rounding (about 0.4% of a block's
 * largest value).
 * Four times fewer instructions a weight: decode reads the codes at memory speed. Codes then lie
 * [panels, in_features / 8, 2 halves of 16 columns, 64 bytes]: byte 4j + i of line (t, h) holds column
 * 16h + j's code for k = 8t + i in its low nibble and for k = 8t + 4 + i in its high one.
 * KVF_DOT without KVF_NIBBLES (byte codes, group 32: Q8_0, Q5_0, Q5_1, Q5_K): [panels, in_features / 4, 2,
 * 64] int8, byte 4j + i of line (t, h) holding column 16h + j's code for k = 4t + i. Signed codes times
 * signed activations go through the unsigned x signed products as |c| x (q with c's sign) (llama.cpp's
 * trick): a pair of them is at most 2 x 128 x 127 < 2^15, widened to 32 bits at once.
 * KVF_DOT with group 16 (byte codes: Q6_K, or a projection fusing it with other formats): the same layout;
 * each block of 32 activations is two groups of weights, each with its own sums, scale and offset:
 * total += d * (s * sum(c * q) + o * sum(q)) for the first 16 k, then for the second.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVF_OK 0
#define KVF_NO_MEMORY 2
#define KVF_BAD_GROUP 3 /* dot products over groups of other than 32, or 16 byte codes */

#define PANEL 32 /* output columns per panel: two 16-float vectors */
#define KVF_NIBBLES 1 /* format bits */
#define KVF_HALF 2
#define KVF_DOT 4
#define KVF_GROUP16 8 /* not a storage bit: dot_matmul's choice of tiles for byte codes in groups of 16 */
#define KVF_ZERO_OFFSETS 16
#define DOT_BLOCK 32 /* activations quantized per 32 of k */
#define HALF_BLOCK 16
#define MAX_TILE 8
/* dot_tile asks for the codes this many blocks ahead (4 KiB of nibbles): the hardware's stream prefetch
 * alone left a decode step's products waiting on memory, the more so the more rows a tile holds (SmolLM2's
 * 120 products at 6 rows 2.86-3.02 -> 2.35-2.41 ms, 8 rows 3.5 -> 2.65, 1 row 2.2 -> 2.0-2.2). */
#define PREFETCH_BLOCKS 8
#ifndef KVF_PARALLEL_WORK
/* Multiply-adds below which one thread does a product alone: a smaller one finishes in the time a second
 * thread takes to join. 4M kept a decode row of SmolLM2's or Gemma 3 270M's projections on one of two
 * cores; at 256K, in process, one stream decodes at 271-292 against 231-240 tok/s (SmolLM2) and 139-140
 * against 105-113 (Gemma), 4 and 16 rows alike or better. */
#define KVF_PARALLEL_WORK (256L << 10)
#endif

#if defined(__AVX512F__) && !defined(KVF_PORTABLE)
#include <immintrin.h>
#define KVF_VECTORS /* a vector path, not the plain C one: the helpers below that use intrinsics may too */
typedef __m512 vec;
static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vec_store(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_broadcast(float x) { return _mm512_set1_ps(x); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vec_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vec_codes(const int8_t *c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
}
static inline vec vec_load_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* 16 bytes: the low nibbles are columns 0..15, the high ones 16..31. */
static inline void vec_nibbles(const uint8_t *c, vec *low, vec *high) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)c), mask = _mm_set1_epi8(0x0F);
    *low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    *high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}
/* 16 int32 sums, columns 0-7 then 8-15, as floats. */
static inline vec vec_of_sums(__m256i lo, __m256i hi) {
    return _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(KVF_PORTABLE)
/* AVX2 machines (no AVX-512): a vector of 16 is two of 8, each lane the same operation as above. */
#include <immintrin.h>
#define KVF_VECTORS
typedef struct {
    __m256 lo, hi;
} vec;
static inline vec vec_load(const float *p) { return (vec){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vec_store(float *p, vec v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline vec vec_zero(void) { return (vec){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vec vec_broadcast(float x) { return (vec){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline vec vec_fma(vec a, vec b, vec c) {
    return (vec){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vec vec_add(vec a, vec b) { return (vec){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline vec vec_mul(vec a, vec b) { return (vec){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline vec vec_of_bytes(__m128i bytes, int is_signed) { /* 16 bytes as 16 floats */
    const __m128i upper = _mm_srli_si128(bytes, 8);
    if (is_signed)
        return (vec){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(upper))};
    return (vec){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(upper))};
}
static inline vec vec_codes(const int8_t *c) { return vec_of_bytes(_mm_loadu_si128((const __m128i *)c), 1); }
static inline vec vec_load_half(const uint16_t *p) {
    return (vec){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
static inline void vec_nibbles(const uint8_t *c, vec *low, vec *high) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)c), mask = _mm_set1_epi8(0x0F);
    *low = vec_of_bytes(_mm_and_si128(bytes, mask), 0);
    *high = vec_of_bytes(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), 0);
}
static inline vec vec_of_sums(__m256i lo, __m256i hi) { return (vec){_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)}; }
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
static inline vec vec_mul(vec a, vec b) {
    for (int j = 0; j < 16; j++) a.lane[j] *= b.lane[j];
    return a;
}
static inline vec vec_codes(const int8_t *c) {
    vec v;
    for (int j = 0; j < 16; j++) v.lane[j] = (float)c[j];
    return v;
}
/* IEEE half to float, exactly (normal, subnormal, zero, inf, NaN). */
static inline float half_to_float(uint16_t h) {
    const int exponent = (h >> 10) & 31, mantissa = h & 1023;
    const float sign = (h & 0x8000) ? -1.f : 1.f;
    if (exponent == 0) return sign * ldexpf((float)mantissa, -24);
    if (exponent == 31) return mantissa ? NAN : sign * INFINITY;
    return sign * ldexpf((float)(mantissa | 1024), exponent - 25);
}
static inline vec vec_load_half(const uint16_t *p) {
    vec v;
    for (int j = 0; j < 16; j++) v.lane[j] = half_to_float(p[j]);
    return v;
}
static inline void vec_nibbles(const uint8_t *c, vec *low, vec *high) {
    for (int j = 0; j < 16; j++) {
        low->lane[j] = (float)(c[j] & 15);
        high->lane[j] = (float)(c[j] >> 4);
    }
}
#endif

/* A group's scales or offsets for the panel's 32 columns, whichever the storage. */
static inline __attribute__((always_inline)) void load_pair(const void *base, int64_t at, int half, vec *a,
                                                            vec *b) {
    if (half) {
        const uint16_t *p = (const uint16_t *)base + at;
        *a = vec_load_half(p);
        *b = vec_load_half(p + 16);
    } else {
        const float *p = (const float *)base + at;
        *a = vec_load(p);
        *b = vec_load(p + 16);
    }
}

/* A group's offsets for the panel's 32 columns: stored, or -8 x the scales s0, s1 where none are (exact:
 * a power of two). */
static inline __attribute__((always_inline)) void load_offsets(const void *base, int64_t at, int half,
                                                               vec s0, vec s1, vec *a, vec *b) {
    if (base != NULL) {
        load_pair(base, at, half, a, b);
    } else {
        *a = vec_mul(s0, vec_broadcast(-8.f));
        *b = vec_mul(s1, vec_broadcast(-8.f));
    }
}

/* A weight from its code, scale and offset: c x s + o, or with zero offsets (KVF_ZERO_OFFSETS) c x s, no
 * offset read or added. The same bits either way: fma(c, s, +0) and c x s differ only in the sign of a zero,
 * and every sum these weights enter starts at +0, to which -0 and +0 add alike. */
static inline __attribute__((always_inline)) vec weight_of(vec c, vec s, vec o, int zero) {
    return zero ? vec_mul(c, s) : vec_fma(c, s, o);
}

/* A group's offsets for the panel's 32 columns as load_offsets gives them; none read with zero offsets. */
static inline __attribute__((always_inline)) void group_offsets(const int format, const void *base, int64_t at,
                                                                vec s0, vec s1, vec *a, vec *b) {
    if (format & KVF_ZERO_OFFSETS)
        *a = *b = vec_zero(); /* never read: weight_of and dot_tile leave the offset term out */
    else
        load_offsets(base, at, format & KVF_HALF, s0, s1, a, b);
}

/* Row k's codes for the panel's 32 columns, as floats: nibbles (column j low, j + 16 high) or bytes. */
static inline __attribute__((always_inline)) void load_codes(const void *codes, int64_t k, int nibbles, vec *c0,
                                                             vec *c1) {
    if (nibbles) {
        vec_nibbles((const uint8_t *)codes + k * (PANEL / 2), c0, c1);
    } else {
        *c0 = vec_codes((const int8_t *)codes + k * PANEL);
        *c1 = vec_codes((const int8_t *)codes + k * PANEL + 16);
    }
}

/* `rows` (<= MAX_TILE) rows times one panel. xt holds the tile's rows transposed, [in_features][rows], so
 * that one pointer serves every broadcast. Two weight vectors per broadcast: with one, the broadcasts
 * (one load each) and not the multiply-adds limit the loop (measured: 1.9 vs 3.7 G multiply-adds/s).
 * Each block of 32 products is summed on its own and then added to the total: one running sum over all
 * of in_features drifted up to 2.3e-4 from float64 in SmolLM2's logits, per block 5.1e-5 (BLAS: 5.5e-5). */
static inline __attribute__((always_inline)) void tile(const int rows, const int format, const float *xt,
                                                       const void *codes, const void *scales,
                                                       const void *offsets, int64_t in_features, int64_t group,
                                                       float *y, int64_t y_stride) {
    const int nibbles = format & KVF_NIBBLES, half = format & KVF_HALF, zero = format & KVF_ZERO_OFFSETS;
    vec total[MAX_TILE][2], acc[MAX_TILE][2];
    for (int m = 0; m < rows; m++) total[m][0] = total[m][1] = vec_zero();
    for (int64_t b = 0; b < in_features / group; b++) {
        vec s0, s1, o0, o1;
        load_pair(scales, b * PANEL, half, &s0, &s1);
        group_offsets(format, offsets, b * PANEL, s0, s1, &o0, &o1);
        for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = vec_zero();
        for (int64_t k = b * group; k < (b + 1) * group; k++) {
            vec c0, c1;
            load_codes(codes, k, nibbles, &c0, &c1);
            const vec w0 = weight_of(c0, s0, o0, zero), w1 = weight_of(c1, s1, o1, zero);
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

typedef void (*tile_fn)(const float *, const void *, const void *, const void *, int64_t, int64_t, float *,
                        int64_t);
/* One function per tile height and storage format (nibbles, half scales, zero offsets), so that every
 * branch above is resolved at compile time. */
#define TILE(ROWS, FORMAT)                                                                                \
    static void tile_##ROWS##_##FORMAT(const float *xt, const void *codes, const void *scales,               \
                                       const void *offsets, int64_t in_features, int64_t group, float *y,     \
                                       int64_t y_stride) {                                                   \
        tile(ROWS, FORMAT, xt, codes, scales, offsets, in_features, group, y, y_stride);                     \
    }
#define TILES(FORMAT) TILE(8, FORMAT) TILE(4, FORMAT) TILE(2, FORMAT) TILE(1, FORMAT)
TILES(0)
TILES(1)
TILES(2)
TILES(3)
TILES(16)
TILES(17)
TILES(18)
TILES(19)
static const tile_fn TILE_FNS[8][4] = { /* [format's storage bits, zero offsets as 4][tile] */
    {tile_8_0, tile_4_0, tile_2_0, tile_1_0},
    {tile_8_1, tile_4_1, tile_2_1, tile_1_1},
    {tile_8_2, tile_4_2, tile_2_2, tile_1_2},
    {tile_8_3, tile_4_3, tile_2_3, tile_1_3},
    {tile_8_16, tile_4_16, tile_2_16, tile_1_16},
    {tile_8_17, tile_4_17, tile_2_17, tile_1_17},
    {tile_8_18, tile_4_18, tile_2_18, tile_1_18},
    {tile_8_19, tile_4_19, tile_2_19, tile_1_19},
};

/* Rows are cut into tiles of 8, then one each of 4, 2 and 1 as needed. */
static int tile_rows(int64_t remaining) {
    return remaining >= 8 ? 8 : remaining >= 4 ? 4 : remaining >= 2 ? 2 : 1;
}

static tile_fn tile_for(int rows, int format) {
    const int variant = (format & (KVF_NIBBLES | KVF_HALF)) | (format & KVF_ZERO_OFFSETS ? 4 : 0);
    return TILE_FNS[variant][rows == 8 ? 0 : rows == 4 ? 1 : rows == 2 ? 2 : 3];
}

/* Many rows (prefill, wide decode batches): each group of a panel's weights is dequantized once, into `w`
 * (in L1), and every tile of STRIP_ROWS rows by 16 columns multiplies it, its sums held in registers on
 * every path; tile() dequantizes per tile, and its 8 x 32 sums and totals (64 of AVX2's 16 ymm registers)
 * spill. Each row's operations are tile()'s in the same order (a group's products from zero by fused
 * multiply-adds over k in order, then added to the row's total, kept in y), so the bits are the same and
 * a row still computes alike in any tile: either kernel may take any call. */
#if defined(__AVX512F__) && !defined(KVF_PORTABLE)
#define STRIP_ROWS 8 /* 8 sums of one zmm, the weights and a broadcast: 10 of 32 registers */
#else
#define STRIP_ROWS 6 /* AVX2: 6 sums of two ymm, the weights (2) and a broadcast: 15 of 16 */
#endif
/* From here the strip is faster (AVX2, one thread, G multiply-adds/s: 3 rows 12 -> 13, 8 rows 14-16 -> 22-23,
 * 256 rows 17 -> 34); one or two rows read each weight once either way, and tile() keeps its totals. */
#define STRIP_MIN_ROWS 3
#define MAX_GROUP 32

/* Group b of the panel's 32 columns, as tile() computes its weights: w[k][j], [group][PANEL]. */
static void dequantize_group(const int format, const void *codes, const void *scales, const void *offsets,
                             int64_t b, int64_t group, float *w) {
    const int nibbles = format & KVF_NIBBLES, half = format & KVF_HALF, zero = format & KVF_ZERO_OFFSETS;
    vec s0, s1, o0, o1;
    load_pair(scales, b * PANEL, half, &s0, &s1);
    group_offsets(format, offsets, b * PANEL, s0, s1, &o0, &o1);
    for (int64_t i = 0; i < group; i++) {
        const int64_t k = b * group + i;
        vec c0, c1;
        load_codes(codes, k, nibbles, &c0, &c1);
        vec_store(w + i * PANEL, weight_of(c0, s0, o0, zero));
        vec_store(w + i * PANEL + 16, weight_of(c1, s1, o1, zero));
    }
}

/* `rows` rows of x (this group's k, x_stride apart) times 16 columns of w: each row's sum over the group,
 * added to its total in y. */
static inline __attribute__((always_inline)) void strip_tile(const int rows, const float *x, int64_t x_stride,
                                                             const float *w, int64_t group, float *y,
                                                             int64_t y_stride) {
    vec acc[STRIP_ROWS];
    for (int m = 0; m < rows; m++) acc[m] = vec_zero();
#pragma GCC unroll 1
    for (int64_t i = 0; i < group; i++) {
        const vec wk = vec_load(w + i * PANEL);
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) acc[m] = vec_fma(vec_broadcast(x[m * x_stride + i]), wk, acc[m]);
    }
    for (int m = 0; m < rows; m++) vec_store(y + m * y_stride, vec_add(vec_load(y + m * y_stride), acc[m]));
}

typedef void (*strip_tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t);
#define STRIP_TILE(ROWS)                                                                                  \
    static void strip_tile_##ROWS(const float *x, int64_t x_stride, const float *w, int64_t group, float *y, \
                                  int64_t y_stride) {                                                      \
        strip_tile(ROWS, x, x_stride, w, group, y, y_stride);                                                \
    }
STRIP_TILE(STRIP_ROWS)
STRIP_TILE(4)
STRIP_TILE(2)
STRIP_TILE(1)

/* Rows are cut into tiles of STRIP_ROWS, then one each of 4, 2 and 1 as needed. */
static int strip_rows(int64_t remaining) {
    return remaining >= STRIP_ROWS ? STRIP_ROWS : remaining >= 4 ? 4 : remaining >= 2 ? 2 : 1;
}

static strip_tile_fn strip_tile_for(int rows) {
    return rows == STRIP_ROWS ? strip_tile_STRIP_ROWS
           : rows == 4        ? strip_tile_4
           : rows == 2        ? strip_tile_2
                              : strip_tile_1;
}

/* One panel for every row: y[m][0..PANEL) of each row m, its totals from zero (as tile()'s). */
static void strip(const int format, const float *x, int64_t x_stride, int64_t rows, const void *codes,
                  const void *scales, const void *offsets, int64_t in_features, int64_t group, float *y,
                  int64_t y_stride) {
    float w[MAX_GROUP * PANEL];
    for (int64_t m = 0; m < rows; m++) memset(y + m * y_stride, 0, sizeof(float) * PANEL);
    for (int64_t b = 0; b < in_features / group; b++) {
        dequantize_group(format, codes, scales, offsets, b, group, w);
        for (int64_t first = 0; first < rows; first += strip_rows(rows - first)) {
            const strip_tile_fn fn = strip_tile_for(strip_rows(rows - first));
            const float *xs = x + first * x_stride + b * group;
            for (int h = 0; h < 2; h++)
                fn(xs, x_stride, w + 16 * h, group, y + first * y_stride + 16 * h, y_stride);
        }
    }
}

/* One block of 32 values of x as int8: codes q, scale *d, and the sums of q per half block of 16 (a weight
 * group of 16 takes one, of 32 both). */
static inline void quantize_block(const float *x, int8_t *q, float *d, int32_t *sum) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(KVF_PORTABLE)
    /* The scalar loop's arithmetic in two vectors, so the same bytes: the max of |x| (order-free), each
     * x * inverse rounded to the nearest even by the conversion (nearbyintf's default mode). */
    const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + HALF_BLOCK);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128((__m128i *)(q + HALF_BLOCK), _mm512_cvtsepi32_epi8(qhi));
    sum[0] = _mm512_reduce_add_epi32(qlo), sum[1] = _mm512_reduce_add_epi32(qhi);
#else
    float amax = 0.f;
    for (int i = 0; i < DOT_BLOCK; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    sum[0] = sum[1] = 0;
    for (int i = 0; i < DOT_BLOCK; i++) {
        const int32_t v = (int32_t)nearbyintf(x[i] * inverse);
        q[i] = (int8_t)v;
        sum[i / HALF_BLOCK] += v;
    }
#endif
    *d = amax / 127.f;
}

/* One row of x as int8 per block of 32 (quantize_block's codes, scales and half-block sums). */
static void quantize_row(const float *x, int64_t n, int8_t *q, float *d, int32_t *sum) {
    for (int64_t b = 0; b < n / DOT_BLOCK; b++)
        quantize_block(x + b * DOT_BLOCK, q + b * DOT_BLOCK, d + b, sum + 2 * b);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(KVF_PORTABLE)
/* acc + the sums of four (u8 weight, s8 activation) products per 32-bit lane. */
static inline __m512i dot4(__m512i acc, __m512i weights, __m512i activations) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, weights, activations);
#else /* pairs to int16 (at most 2 * 15 * 127: no saturation), then pairs of those to int32 */
    const __m512i pairs = _mm512_maddubs_epi16(weights, activations);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}

/* One block's integer sums sum(c * q) for `rows` rows and the panel's 32 columns, as floats: 4 steps of
 * 8 k, each two 64-byte lines (columns 0-15, 16-31); each broadcast of 4 activations serves both. */
static inline __attribute__((always_inline)) void block_sums(const int rows, const uint8_t *codes,
                                                             const int8_t *q, int64_t q_stride,
                                                             vec sums[MAX_TILE][2]) {
    __m512i acc[MAX_TILE][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < DOT_BLOCK / 8; t++) {
        __m512i low[2], high[2];
        for (int h = 0; h < 2; h++) {
            const __m512i w = _mm512_loadu_si512((const void *)(codes + (2 * t + h) * 64));
            low[h] = _mm512_and_si512(w, mask);
            high[h] = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask);
        }
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            int32_t k[2]; /* four activations each; memcpy, not a cast: int8 storage read as int32 */
            memcpy(k, q + m * q_stride + t * 8, sizeof k);
            const __m512i first = _mm512_set1_epi32(k[0]), second = _mm512_set1_epi32(k[1]);
            for (int h = 0; h < 2; h++) acc[m][h] = dot4(dot4(acc[m][h], low[h], first), high[h], second);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int h = 0; h < 2; h++) sums[m][h] = _mm512_cvtepi32_ps(acc[m][h]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(KVF_PORTABLE)
/* As above on 32-byte lines (each 64-byte line is two: columns 16h + 0-7 and 16h + 8-15), with no VNNI and
 * half the multiply throughput: the block's products are summed as int16 and widened once. Each vpmaddubsw
 * lane is two products of at most 15 x 127, so the block's 8 of them per lane stay within 8 x 3810 = 30480
 * < 2^15: the sums are exact, the same integers as every other path. 16 vector registers, not 32: tiles of
 * at most 4 rows (DOT_TILE_MAX) and one half panel at a time keep the 8 sums, 4 weight vectors and 2
 * broadcasts in registers. */
#define DOT_TILE_MAX 4
static inline __attribute__((always_inline)) void block_sums(const int rows, const uint8_t *codes,
                                                             const int8_t *q, int64_t q_stride,
                                                             vec sums[MAX_TILE][2]) {
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256i acc[DOT_TILE_MAX][2]; /* [row][which 8 columns of half h], int16 */
        for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 1 /* unrolled, GCC hoists every step's weights together and spills them to the stack */
        for (int t = 0; t < DOT_BLOCK / 8; t++) {
            __m256i low[2], high[2];
            for (int e = 0; e < 2; e++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(codes + (2 * t + h) * 64 + 32 * e));
                low[e] = _mm256_and_si256(w, mask);
                high[e] = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
            }
            for (int m = 0; m < rows; m++) {
                int32_t k[2];
                memcpy(k, q + m * q_stride + t * 8, sizeof k);
                const __m256i lo4 = _mm256_set1_epi32(k[0]), hi4 = _mm256_set1_epi32(k[1]);
                for (int e = 0; e < 2; e++) {
                    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low[e], lo4),
                                                           _mm256_maddubs_epi16(high[e], hi4));
                    acc[m][e] = _mm256_add_epi16(acc[m][e], pairs);
                }
            }
        }
        for (int m = 0; m < rows; m++)
            sums[m][h] = (vec){_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[m][0], ones)),
                               _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[m][1], ones))};
    }
}
#else
/* Plain C, either dot layout (nibbles: 8 k a line, bytes: 4): column 16h + j's code for k of the block. */
static inline int32_t dot_code(const uint8_t *codes, int nibbles, int h, int j, int k) {
    if (!nibbles) return (int8_t)codes[(2 * (k / 4) + h) * 64 + 4 * j + k % 4];
    const uint8_t byte = codes[(2 * (k / 8) + h) * 64 + 4 * j + k % 4];
    return k % 8 < 4 ? byte & 15 : byte >> 4;
}
static inline void scalar_block_sums(const int rows, const uint8_t *codes, int nibbles, const int8_t *q,
                                     int64_t q_stride, int first, int last, vec sums[MAX_TILE][2]) {
    for (int m = 0; m < rows; m++)
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 16; j++) {
                int32_t acc = 0;
                for (int k = first; k < last; k++) acc += dot_code(codes, nibbles, h, j, k) * q[m * q_stride + k];
                sums[m][h].lane[j] = (float)acc;
            }
}
static inline __attribute__((always_inline)) void block_sums(const int rows, const uint8_t *codes,
                                                             const int8_t *q, int64_t q_stride,
                                                             vec sums[MAX_TILE][2]) {
    scalar_block_sums(rows, codes, 1, q, q_stride, 0, DOT_BLOCK, sums);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(KVF_PORTABLE)
/* Byte codes: one block's sums over steps of 4 k, each two 64-byte lines (columns 0-15, 16-31) of 16
 * columns x 4 codes, a line a vector: |c| (unsigned) times q with c's sign, one dot4 a line and row. Why
 * not the AVX2 path's 256-bit lines: an LM head of byte codes (Gemma 3's 262144 x 640) is the largest
 * product of a step, and with 5 rows (a speculative step's) that path took twice the time of one row. */
static inline __attribute__((always_inline)) void byte_block_sums(const int rows, const int8_t *codes,
                                                                  const int8_t *q, int64_t q_stride,
                                                                  int first, int last,
                                                                  vec sums[MAX_TILE][2]) {
    __m512i acc[MAX_TILE][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
    const __m512i zero = _mm512_setzero_si512();
    for (int t = first / 4; t < last / 4; t++) {
        __m512i magnitude[2];
        __mmask64 negative[2];
        for (int h = 0; h < 2; h++) {
            const __m512i c = _mm512_loadu_si512((const void *)(codes + (2 * t + h) * 64));
            magnitude[h] = _mm512_abs_epi8(c); /* -128 gives 0x80: 128 read unsigned */
            negative[h] = _mm512_movepi8_mask(c);
        }
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            int32_t k;
            memcpy(&k, q + m * q_stride + t * 4, sizeof k);
            const __m512i four = _mm512_set1_epi32(k);
            for (int h = 0; h < 2; h++)
                acc[m][h] = dot4(acc[m][h], magnitude[h], _mm512_mask_sub_epi8(four, negative[h], zero, four));
        }
    }
    for (int m = 0; m < rows; m++)
        for (int h = 0; h < 2; h++) sums[m][h] = _mm512_cvtepi32_ps(acc[m][h]);
}
#elif defined(__AVX2__) && defined(KVF_VECTORS) /* AVX2 without F16C has no vector path above */
/* Byte codes: one block's sums over 8 steps of 4 k, each two 64-byte lines (columns 0-15, 16-31) of 16
 * columns x 4 codes, 32 bytes (8 columns) at a time. */
static inline __attribute__((always_inline)) void byte_block_sums(const int rows, const int8_t *codes,
                                                                  const int8_t *q, int64_t q_stride,
                                                                  int first, int last,
                                                                  vec sums[MAX_TILE][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256i acc[MAX_TILE][2]; /* [row][which 8 columns of half h], int32 */
        for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int t = first / 4; t < last / 4; t++) {
            __m256i sign[2], magnitude[2];
            for (int e = 0; e < 2; e++) {
                sign[e] = _mm256_loadu_si256((const __m256i *)(codes + (2 * t + h) * 64 + 32 * e));
                magnitude[e] = _mm256_abs_epi8(sign[e]);
            }
            for (int m = 0; m < rows; m++) {
                int32_t k;
                memcpy(&k, q + m * q_stride + t * 4, sizeof k);
                const __m256i four = _mm256_set1_epi32(k);
                for (int e = 0; e < 2; e++) {
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude[e], _mm256_sign_epi8(four, sign[e]));
                    acc[m][e] = _mm256_add_epi32(acc[m][e], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int m = 0; m < rows; m++) sums[m][h] = vec_of_sums(acc[m][0], acc[m][1]);
    }
}
#else /* plain C: wherever this runs, so does block_sums' plain C above */
static inline __attribute__((always_inline)) void byte_block_sums(const int rows, const int8_t *codes,
                                                                  const int8_t *q, int64_t q_stride,
                                                                  int first, int last,
                                                                  vec sums[MAX_TILE][2]) {
    scalar_block_sums(rows, (const uint8_t *)codes, 0, q, q_stride, first, last, sums);
}
#endif

/* `rows` (<= MAX_TILE) rows times one panel; rows of q are in_features apart, of qsum 2 x blocks.
 * Per group of weights (a block of 32 activations, or each half of it with KVF_GROUP16):
 * total += d * (s * sum(c * q) + o * sum(q)). */
static inline __attribute__((always_inline)) void dot_tile(const int rows, const int format, const int8_t *q,
                                                           const float *d, const int32_t *qsum,
                                                           const uint8_t *codes, const void *scales,
                                                           const void *offsets, int64_t in_features, float *y,
                                                           int64_t y_stride) {
    const int64_t blocks = in_features / DOT_BLOCK;
    const int per_block = format & KVF_GROUP16 ? 2 : 1, span = DOT_BLOCK / per_block;
    vec total[MAX_TILE][2], sums[MAX_TILE][2];
    for (int m = 0; m < rows; m++) total[m][0] = total[m][1] = vec_zero();
    const int64_t block_bytes = format & KVF_NIBBLES ? DOT_BLOCK * PANEL / 2 : DOT_BLOCK * PANEL;
    for (int64_t b = 0; b < blocks; b++) {
        /* past the panel: the next one's codes (they follow it), or past the weights (a prefetch never
         * faults; the address is formed as an integer) */
        const uintptr_t ahead = (uintptr_t)codes + (uintptr_t)((b + PREFETCH_BLOCKS) * block_bytes);
        for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch((const void *)(ahead + line));
        for (int g = 0; g < per_block; g++) {
            if (format & KVF_NIBBLES)
                block_sums(rows, codes + b * DOT_BLOCK * PANEL / 2, q + b * DOT_BLOCK, in_features, sums);
            else
                byte_block_sums(rows, (const int8_t *)codes + b * DOT_BLOCK * PANEL, q + b * DOT_BLOCK,
                                in_features, g * span, (g + 1) * span, sums);
            vec s[2], o[2];
            const int64_t at = (b * per_block + g) * PANEL;
            load_pair(scales, at, format & KVF_HALF, &s[0], &s[1]);
            group_offsets(format, offsets, at, s[0], s[1], &o[0], &o[1]);
            for (int m = 0; m < rows; m++) {
                const int32_t *halves = qsum + m * 2 * blocks + 2 * b; /* integers: the same sum either way */
                const int32_t sum_q = per_block == 2 ? halves[g] : halves[0] + halves[1];
                const vec qs = vec_broadcast((float)sum_q), dm = vec_broadcast(d[m * blocks + b]);
                for (int h = 0; h < 2; h++) { /* with zero offsets, o x sum(q) is left out (weight_of's bits) */
                    const vec scaled = vec_mul(s[h], sums[m][h]);
                    const vec block = format & KVF_ZERO_OFFSETS ? scaled : vec_fma(o[h], qs, scaled);
                    total[m][h] = vec_fma(dm, block, total[m][h]);
                }
            }
        }
    }
    for (int m = 0; m < rows; m++) {
        vec_store(y + m * y_stride, total[m][0]);
        vec_store(y + m * y_stride + 16, total[m][1]);
    }
}

typedef void (*dot_tile_fn)(const int8_t *, const float *, const int32_t *, const uint8_t *, const void *,
                            const void *, int64_t, float *, int64_t);
#define DOT_TILE(ROWS, FORMAT)                                                                            \
    static void dot_tile_##ROWS##_##FORMAT(const int8_t *q, const float *d, const int32_t *qsum,           \
                                           const uint8_t *codes, const void *scales, const void *offsets,  \
                                           int64_t in_features, float *y, int64_t y_stride) {              \
        dot_tile(ROWS, FORMAT, q, d, qsum, codes, scales, offsets, in_features, y, y_stride);            \
    }
#ifndef DOT_TILE_MAX
#define DOT_TILE_MAX MAX_TILE
#endif
/* Every tile height up to DOT_TILE_MAX, so that a speculative step's K + 1 rows (5 for K = 4) are one tile
 * reading each panel once, not a tile of 4 and another of 1 (Gemma 3's LM head: 5.2 ms against 4.1 for 8
 * rows). */
#if DOT_TILE_MAX >= 8
#define DOT_TILES(FORMAT)                                                                                \
    DOT_TILE(8, FORMAT) DOT_TILE(7, FORMAT) DOT_TILE(6, FORMAT) DOT_TILE(5, FORMAT) DOT_TILE(4, FORMAT)  \
    DOT_TILE(3, FORMAT) DOT_TILE(2, FORMAT) DOT_TILE(1, FORMAT)
#define DOT_ROW(FORMAT)                                                                                  \
    {dot_tile_1_##FORMAT, dot_tile_2_##FORMAT, dot_tile_3_##FORMAT, dot_tile_4_##FORMAT,                 \
     dot_tile_5_##FORMAT, dot_tile_6_##FORMAT, dot_tile_7_##FORMAT, dot_tile_8_##FORMAT}
#else /* AVX2: block_sums holds 4 rows, and dot_tile_rows asks for no more */
#define DOT_TILES(FORMAT) DOT_TILE(4, FORMAT) DOT_TILE(3, FORMAT) DOT_TILE(2, FORMAT) DOT_TILE(1, FORMAT)
#define DOT_ROW(FORMAT) {dot_tile_1_##FORMAT, dot_tile_2_##FORMAT, dot_tile_3_##FORMAT, dot_tile_4_##FORMAT}
#endif
DOT_TILES(0)
DOT_TILES(1)
DOT_TILES(2)
DOT_TILES(3)
DOT_TILES(8)
DOT_TILES(10)
DOT_TILES(16)
DOT_TILES(17)
DOT_TILES(18)
DOT_TILES(19)
DOT_TILES(24)
DOT_TILES(26)
static const dot_tile_fn DOT_TILE_FNS[12][DOT_TILE_MAX] = { /* [dot_variant(format)][tile height - 1] */
    DOT_ROW(0),  DOT_ROW(1),  DOT_ROW(2),  DOT_ROW(3),  DOT_ROW(8),  DOT_ROW(10),
    DOT_ROW(16), DOT_ROW(17), DOT_ROW(18), DOT_ROW(19), DOT_ROW(24), DOT_ROW(26),
};

/* DOT_TILE_FNS' row: the storage bits (nibbles, half scales), byte codes in groups of 16, then the same
 * with zero offsets. */
static int dot_variant(int64_t format) {
    const int zero = format & KVF_ZERO_OFFSETS ? 6 : 0;
    return zero + (format & KVF_GROUP16 ? 4 + !!(format & KVF_HALF) : (int)(format & (KVF_NIBBLES | KVF_HALF)));
}

/* All that remain, up to what this path's block_sums holds. */
static int dot_tile_rows(int64_t remaining) {
    return remaining >= DOT_TILE_MAX ? DOT_TILE_MAX : (int)remaining;
}

static int dot_matmul(const float *x, int64_t x_stride, int64_t rows, const void *codes, const void *scales,
                      const void *offsets, int64_t in_features, int64_t panels, int64_t format, float *y,
                      int num_threads) {
    const int64_t out_features = panels * PANEL, blocks = in_features / DOT_BLOCK;
    const int64_t groups = format & KVF_GROUP16 ? 2 * blocks : blocks; /* of scales, per panel column */
    int8_t *q = malloc((size_t)(rows * in_features));
    float *d = malloc(sizeof(float) * rows * blocks);
    int32_t *qsum = malloc(sizeof(int32_t) * rows * 2 * blocks);
    if (q == NULL || d == NULL || qsum == NULL) {
        free(q), free(d), free(qsum);
        return KVF_NO_MEMORY;
    }
    const int64_t scale_bytes = format & KVF_HALF ? 2 : 4;
    /* One team for both loops: the rows are quantized across the threads (each row alone: the same bytes
     * whichever thread does it), and the barrier between the loops hands every panel all of them. */
#pragma omp parallel num_threads(num_threads) if (rows * in_features * out_features >= KVF_PARALLEL_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            quantize_row(x + r * x_stride, in_features, q + r * in_features, d + r * blocks, qsum + r * 2 * blocks);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const uint8_t *c = (const uint8_t *)codes + p * in_features * (format & KVF_NIBBLES ? PANEL / 2 : PANEL);
            const char *s = (const char *)scales + p * groups * PANEL * scale_bytes;
            const char *o = offsets ? (const char *)offsets + p * groups * PANEL * scale_bytes : NULL;
            for (int64_t first = 0; first < rows; first += dot_tile_rows(rows - first)) {
                const int n = dot_tile_rows(rows - first);
                DOT_TILE_FNS[dot_variant(format)][n - 1](
                    q + first * in_features, d + first * blocks, qsum + first * 2 * blocks, c, s, o, in_features,
                    y + first * out_features + p * PANEL, out_features);
            }
        }
    }
    free(q), free(d), free(qsum);
    return KVF_OK;
}

/* x's rows as tile() reads them: each tile's rows transposed, [in_features][tile rows], tile after tile
 * (NULL when out of memory; the caller frees it). */
static float *tiles_transposed(const float *x, int64_t x_stride, int64_t rows, int64_t in_features) {
    float *xt = malloc(sizeof(float) * rows * in_features);
    if (xt == NULL) return NULL;
    for (int64_t first = 0; first < rows; first += tile_rows(rows - first)) {
        const int n = tile_rows(rows - first);
        for (int i = 0; i < n; i++)
            for (int64_t k = 0; k < in_features; k++)
                xt[first * in_features + k * n + i] = x[(first + i) * x_stride + k];
    }
    return xt;
}

int packed_matmul(const float *x, int64_t x_stride, int64_t rows, const void *codes, const void *scales,
                  const void *offsets, int64_t in_features, int64_t group, int64_t panels, int64_t format,
                  float *y, int num_threads) {
    if (format & KVF_DOT) {
        if (in_features % DOT_BLOCK || (group != DOT_BLOCK && (group != HALF_BLOCK || format & KVF_NIBBLES)))
            return KVF_BAD_GROUP;
        const int64_t variant = format | (group == HALF_BLOCK ? KVF_GROUP16 : 0);
        return dot_matmul(x, x_stride, rows, codes, scales, offsets, in_features, panels, variant, y, num_threads);
    }
    const int64_t out_features = panels * PANEL, blocks = in_features / group;
    /* the strip's weights buffer holds a group of at most MAX_GROUP (the packer makes 16 or 32) */
    const int strips = rows >= STRIP_MIN_ROWS && group <= MAX_GROUP;
    float *xt = NULL;
    if (!strips && (xt = tiles_transposed(x, x_stride, rows, in_features)) == NULL) return KVF_NO_MEMORY;
    /* Threads only where each gets enough to do (KVF_PARALLEL_WORK). */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * in_features * out_features >= KVF_PARALLEL_WORK)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t code_bytes = format & KVF_NIBBLES ? PANEL / 2 : PANEL, scale_bytes = format & KVF_HALF ? 2 : 4;
        const char *c = (const char *)codes + p * in_features * code_bytes;
        const char *s = (const char *)scales + p * blocks * PANEL * scale_bytes;
        const char *o = offsets ? (const char *)offsets + p * blocks * PANEL * scale_bytes : NULL;
        if (strips) {
            strip((int)format, x, x_stride, rows, c, s, o, in_features, group, y + p * PANEL, out_features);
            continue;
        }
        for (int64_t first = 0; first < rows; first += tile_rows(rows - first))
            tile_for(tile_rows(rows - first), (int)format)(xt + first * in_features, c, s, o, in_features, group,
                                                          y + first * out_features + p * PANEL, out_features);
    }
    free(xt);
    return KVF_OK;
}
