/* Decode attention straight over the paged KV pool: one query token per row, float32 arithmetic over a
 * pool of float32 or float16 (`kv_half`: half the bytes read, which is what decode attention waits on).
 *
 * Why a kernel: the torch path gathers every row's pages into a padded copy and then runs SDPA over it,
 * so each step reads the KV three times (gather read, gather write, attention read) and pays SDPA's
 * per-call set-up for a single query. Here each row reads its own pages once, in place.
 *
 * Contract:
 *   q             [rows, num_heads, head_dim], rows `q_row_stride` floats apart, heads contiguous
 *   k_cache/v_cache [num_pages, page_size, num_kv_heads, head_dim], contiguous (one layer of the pool),
 *                 float32, or float16 where kv_half is 1
 *   block_tables  [rows, table_width] int64; row r reads pages block_tables[r][0 .. ceil(ctx/page_size))
 *   context_lens  [rows] int64; row r's context: its tokens [0, context_lens[r])
 *   window        > 0: row r attends over its last `window` tokens only (a sliding-window layer), never
 *                 reading the pages before them; 0: over its whole context
 *   out           [rows, num_heads, head_dim], contiguous
 * Query head h reads KV head h / (num_heads / num_kv_heads), as HF's repeat_kv does.
 *
 * Every page id and length is checked before anything is read: a bad block table returns
 * KVF_BAD_TABLE and reads nothing, so a bookkeeping error fails closed instead of reading memory
 * outside the pool. Rows are independent and computed in a fixed order, so a row's output does not depend
 * on what it is batched with.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Float16 K and V widened to float32 (exactly: every float16 is a float32) inside a dot product and a
 * scaled add over one head, and rounded from float32 as the C layer writes them: 16 or 8 at a time where
 * the CPU converts vectors (AVX-512, F16C). GCC converts _Float16 one element at a time (the kernel ran
 * 7.5x slower over a float16 pool than over a float32 one), so the vector loops are written out. The order
 * of the sums depends on head_dim alone: a row computes alike in any batch. */
#if defined(__AVX512F__) && !defined(KVF_PORTABLE)
#include <immintrin.h>
#define HALF_LANES 16
typedef __m512 lanes;
static inline lanes lanes_of_half(const _Float16 *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline lanes lanes_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void lanes_store(float *p, lanes v) { _mm512_storeu_ps(p, v); }
static inline lanes lanes_fma(lanes a, lanes b, lanes c) { return _mm512_fmadd_ps(a, b, c); }
static inline lanes lanes_zero(void) { return _mm512_setzero_ps(); }
static inline lanes lanes_broadcast(float x) { return _mm512_set1_ps(x); }
static inline float lanes_sum(lanes v) { return _mm512_reduce_add_ps(v); }
static inline void lanes_store_half(_Float16 *p, lanes v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__F16C__) && defined(__FMA__) && defined(__AVX__) && !defined(KVF_PORTABLE)
#include <immintrin.h>
#define HALF_LANES 8
typedef __m256 lanes;
static inline lanes lanes_of_half(const _Float16 *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline lanes lanes_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void lanes_store(float *p, lanes v) { _mm256_storeu_ps(p, v); }
static inline lanes lanes_fma(lanes a, lanes b, lanes c) { return _mm256_fmadd_ps(a, b, c); }
static inline lanes lanes_zero(void) { return _mm256_setzero_ps(); }
static inline lanes lanes_broadcast(float x) { return _mm256_set1_ps(x); }
static inline float lanes_sum(lanes v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}
static inline void lanes_store_half(_Float16 *p, lanes v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

/* q . k over n values, k in float16. */
static inline float half_dot(const float *q, const _Float16 *k, int64_t n) {
    int64_t i = 0;
    float dot = 0.f;
#ifdef HALF_LANES
    lanes acc = lanes_zero();
    for (; i + HALF_LANES <= n; i += HALF_LANES) acc = lanes_fma(lanes_load(q + i), lanes_of_half(k + i), acc);
    dot = lanes_sum(acc);
#endif
    for (; i < n; i++) dot += q[i] * (float)k[i];
    return dot;
}

/* o += p * v over n values, v in float16. */
static inline void half_axpy(float *o, float p, const _Float16 *v, int64_t n) {
    int64_t i = 0;
#ifdef HALF_LANES
    const lanes weight = lanes_broadcast(p);
    for (; i + HALF_LANES <= n; i += HALF_LANES)
        lanes_store(o + i, lanes_fma(weight, lanes_of_half(v + i), lanes_load(o + i)));
#endif
    for (; i < n; i++) o[i] += p * (float)v[i];
}

/* out = values rounded to the nearest float16 (ties to even, as torch's .half()): the C layer's writes of K
 * and V into a float16 pool. */
void kvf_round_half(_Float16 *out, const float *values, int64_t n) {
    int64_t i = 0;
#ifdef HALF_LANES
    for (; i + HALF_LANES <= n; i += HALF_LANES) lanes_store_half(out + i, lanes_load(values + i));
#endif
    for (; i < n; i++) out[i] = (_Float16)values[i];
}

#define KVF_OK 0
#define KVF_BAD_TABLE 1
#define KVF_NO_MEMORY 2

/* Let the compiler call glibc's vector expf (libmvec) in the softmax loop. */
#pragma omp declare simd notinbranch
extern float expf(float);

static int tables_are_valid(const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                            int64_t rows, int64_t page_size, int64_t num_pages) {
    for (int64_t row = 0; row < rows; row++) {
        const int64_t ctx = context_lens[row];
        if (ctx < 1 || ctx > table_width * page_size) return 0;
        const int64_t *table = block_tables + row * table_width;
        for (int64_t p = 0; p < (ctx + page_size - 1) / page_size; p++)
            if (table[p] < 0 || table[p] >= num_pages) return 0;
    }
    return 1;
}

/* One row over tokens [first, ctx): scores[h][t] = q_h . k_t * scale, softmax over t, out_h = sum_t p v_t.
 * The walk goes page by page from the page holding `first`, so no page before the window is touched. */
static inline __attribute__((always_inline)) int attend_row(const int half, const float *q, const void *k_cache,
                                                           const void *v_cache, const int64_t *table,
                                                           int64_t first, int64_t ctx, float *out,
                                                           int64_t num_heads, int64_t group, int64_t head_dim,
                                                           int64_t page_size, int64_t token_stride, float scale) {
    const int64_t page_stride = page_size * token_stride, span = ctx - first;
    float *scores = malloc(sizeof(float) * num_heads * (span + 2));
    if (scores == NULL) return KVF_NO_MEMORY;
    float *row_max = scores + num_heads * span, *row_sum = row_max + num_heads;
    for (int64_t h = 0; h < num_heads; h++) row_max[h] = -INFINITY;
    for (int64_t t = first; t < ctx;) {
        const int64_t slot = t % page_size, n = ctx - t < page_size - slot ? ctx - t : page_size - slot;
        const int64_t page = table[t / page_size] * page_stride + slot * token_stride;
        for (int64_t j = 0; j < n; j++)
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t k = page + j * token_stride + (h / group) * head_dim;
                const float *qh = q + h * head_dim;
                float dot = 0.f;
                if (half) {
                    dot = half_dot(qh, (const _Float16 *)k_cache + k, head_dim);
                } else {
                    const float *kf = (const float *)k_cache + k;
#pragma omp simd reduction(+ : dot)
                    for (int64_t i = 0; i < head_dim; i++) dot += qh[i] * kf[i];
                }
                dot *= scale;
                scores[h * span + t - first + j] = dot;
                row_max[h] = dot > row_max[h] ? dot : row_max[h];
            }
        t += n;
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * span, total = 0.f;
        const float m = row_max[h];
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < span; t++) {
            s[t] = expf(s[t] - m);
            total += s[t];
        }
        row_sum[h] = total;
    }
    for (int64_t i = 0; i < num_heads * head_dim; i++) out[i] = 0.f;
    for (int64_t t = first; t < ctx;) {
        const int64_t slot = t % page_size, n = ctx - t < page_size - slot ? ctx - t : page_size - slot;
        const int64_t page = table[t / page_size] * page_stride + slot * token_stride;
        for (int64_t j = 0; j < n; j++)
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t v = page + j * token_stride + (h / group) * head_dim;
                const float p = scores[h * span + t - first + j];
                float *o = out + h * head_dim;
                if (half) {
                    half_axpy(o, p, (const _Float16 *)v_cache + v, head_dim);
                    continue;
                }
                const float *vf = (const float *)v_cache + v;
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++) o[i] += p * vf[i];
            }
        t += n;
    }
    for (int64_t h = 0; h < num_heads; h++)
        for (int64_t i = 0; i < head_dim; i++) out[h * head_dim + i] /= row_sum[h];
    free(scores);
    return KVF_OK;
}

/* One function per pool element type, so that the conversion is resolved at compile time. */
#define ATTEND_ROW(NAME, HALF)                                                                            \
    static int NAME(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,          \
                    int64_t first, int64_t ctx, float *out, int64_t num_heads, int64_t group,                \
                    int64_t head_dim, int64_t page_size, int64_t token_stride, float scale) {                \
        return attend_row(HALF, q, k_cache, v_cache, table, first, ctx, out, num_heads, group, head_dim,     \
                          page_size, token_stride, scale);                                                   \
    }
ATTEND_ROW(attend_row_float, 0)
ATTEND_ROW(attend_row_half, 1)

int paged_decode_attention(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           int64_t kv_half, int64_t num_pages, const int64_t *block_tables, int64_t table_width,
                           const int64_t *context_lens, float *out, int64_t rows, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale,
                           int64_t window, int num_threads) {
    if (!tables_are_valid(block_tables, table_width, context_lens, rows, page_size, num_pages))
        return KVF_BAD_TABLE;
    int status = KVF_OK;
    int (*const attend)(const float *, const void *, const void *, const int64_t *, int64_t, int64_t, float *,
                        int64_t, int64_t, int64_t, int64_t, int64_t, float) =
        kv_half ? attend_row_half : attend_row_float;
#pragma omp parallel for schedule(static, 1) num_threads(num_threads) if (rows > 1)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t ctx = context_lens[row], first = window > 0 && ctx > window ? ctx - window : 0;
        const int row_status = attend(q + row * q_row_stride, k_cache, v_cache, block_tables + row * table_width,
                                      first, ctx, out + row * num_heads * head_dim, num_heads,
                                      num_heads / num_kv_heads, head_dim, page_size, num_kv_heads * head_dim, scale);
        if (row_status != KVF_OK) {
#pragma omp atomic write
            status = row_status;
        }
    }
    return status;
}

/* Prefill attention: the queries of one chunk, at positions [start, start + rows), over its context's pages
 * [0, ceil((start + rows) / page_size)) of `table` (its new K/V already written there).
 *
 * Why a kernel: SDPA's rounding changes with the shape of the call (how many queries and keys a chunk
 * has), and with int8 activations that moved SmolLM2's logits by up to 0.7 between a prompt prefilled whole
 * and in chunks. Here a query row's arithmetic depends on its position (and window) alone: every score is
 * one fma chain over head_dim from 0, its softmax runs over its own keys in a fixed order, and its output
 * adds p * v key by key from its first key, so a prompt's logits are the same bits however it is chunked
 * (and whatever shares the step). Speed (on a par with SDPA's flash kernel, measured) comes from a float32
 * copy of the context made once per call, keys in blocks of a vector's width; the query heads that share a
 * kv head computed together (each key vector read once for them); and 16 query rows at a time walking the
 * context in chunks of 256 keys, so a chunk is read from cache by every row of the task.
 *
 * Contract: q [rows, num_heads, head_dim] (rows `q_row_stride` floats apart), out the same, contiguous;
 * the pool as for decode; window > 0: query p attends over keys (p - window, p] and no page before the
 * chunk's first query's window is read. Pages are checked before anything is read (KVF_BAD_TABLE). */
#ifdef HALF_LANES
#define PRE_LANES HALF_LANES
typedef lanes pre_lanes;
static inline pre_lanes pre_load(const float *p) { return lanes_load(p); }
static inline void pre_store(float *p, pre_lanes v) { lanes_store(p, v); }
static inline pre_lanes pre_fma(pre_lanes a, pre_lanes b, pre_lanes c) { return lanes_fma(a, b, c); }
static inline pre_lanes pre_zero(void) { return lanes_zero(); }
static inline pre_lanes pre_broadcast(float x) { return lanes_broadcast(x); }
#else
#define PRE_LANES 1
typedef float pre_lanes;
static inline pre_lanes pre_load(const float *p) { return *p; }
static inline void pre_store(float *p, pre_lanes v) { *p = v; }
static inline pre_lanes pre_fma(pre_lanes a, pre_lanes b, pre_lanes c) { return fmaf(a, b, c); }
static inline pre_lanes pre_zero(void) { return 0.f; }
static inline pre_lanes pre_broadcast(float x) { return x; }
#endif
#define PRE_HEADS 4 /* query heads of a group computed together (each reads the same keys) */
#define PRE_ROUND(n) (((n) + PRE_LANES - 1) / PRE_LANES * PRE_LANES)

/* The context's keys [first, ctx) of kv head g in blocks of PRE_LANES keys, each block's head_dim vectors
 * together (key t at kt[g][(t - first) / L][d][(t - first) % L], zeros past the last key): a block's
 * scores read 64 contiguous vectors. Values as vf[g][t - first][d]. All float32. */
static void widen_context(const void *k_cache, const void *v_cache, int64_t kv_half, const int64_t *table,
                          int64_t first, int64_t ctx, int64_t num_kv_heads, int64_t head_dim, int64_t page_size,
                          float *kt, float *vf) {
    const int64_t n = ctx - first, padded = PRE_ROUND(n), token_stride = num_kv_heads * head_dim;
    for (int64_t i = 0; i < num_kv_heads * head_dim * padded; i++) kt[i] = 0.f;
    for (int64_t t = first; t < ctx; t++) {
        const int64_t at = table[t / page_size] * page_size * token_stride + (t % page_size) * token_stride;
        const int64_t u = t - first, block = u / PRE_LANES * head_dim * PRE_LANES + u % PRE_LANES;
        for (int64_t g = 0; g < num_kv_heads; g++) {
            float *key = kt + g * head_dim * padded + block, *value = vf + (g * n + u) * head_dim;
            const int64_t i = at + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) {
                key[d * PRE_LANES] = kv_half ? (float)((const _Float16 *)k_cache)[i + d] : ((const float *)k_cache)[i + d];
                value[d] = kv_half ? (float)((const _Float16 *)v_cache)[i + d] : ((const float *)v_cache)[i + d];
            }
        }
    }
}

#define PRE_DIMS (4 * PRE_LANES) /* head dims a pass of p . v keeps in registers, per head */
#define PRE_ROWS 16                /* query rows of a task: they share each key chunk while it is in cache */
#define PRE_CHUNK 256              /* keys a pass reads (a multiple of PRE_LANES) */

/* A query row's heads [h0, h0 + nh) (nh <= PRE_HEADS, one kv head: kt, vf), its keys [skip, skip + span) of
 * the context. Each head's scores live in an aligned region of `scores` (`stride` floats a head, from
 * PRE_LANES on), so the softmax loop runs alike for every row of the same span whatever `skip` is. The
 * functions below are inlined per nh (accumulators in registers); a key chunk [lo, hi) is one pass. */
struct pre_row {
    const float *q;
    float *scores, *out;
    int64_t skip, span;
};

/* The row's scores (q . k, one fma chain over head_dim from 0, times scale) for its keys in [lo, hi). */
static inline __attribute__((always_inline)) void score_chunk(const struct pre_row *r, const float *kt, int64_t lo,
                                                               int64_t hi, const int64_t nh, int64_t head_dim,
                                                               int64_t stride, float scale) {
    const pre_lanes scaled = pre_broadcast(scale);
    const int64_t from = r->skip > lo ? r->skip : lo, to = r->skip + r->span < hi ? r->skip + r->span : hi;
    for (int64_t b = from / PRE_LANES; b * PRE_LANES < to; b++) {
        const float *block = kt + b * head_dim * PRE_LANES;
        pre_lanes acc[PRE_HEADS];
        for (int64_t j = 0; j < nh; j++) acc[j] = pre_zero();
        for (int64_t d = 0; d < head_dim; d++) {
            const pre_lanes keys = pre_load(block + d * PRE_LANES);
            for (int64_t j = 0; j < nh; j++) acc[j] = pre_fma(pre_broadcast(r->q[j * head_dim + d]), keys, acc[j]);
        }
        for (int64_t j = 0; j < nh; j++)
            pre_store(r->scores + j * stride + PRE_LANES + b * PRE_LANES - r->skip, acc[j] * scaled);
    }
}

/* The row's scores turned into exp(s - max) in place; each head's sum of them into total. */
static inline __attribute__((always_inline)) void softmax_row(const struct pre_row *r, const int64_t nh,
                                                               int64_t stride, float *total) {
    for (int64_t j = 0; j < nh; j++) {
        float *s = r->scores + j * stride + PRE_LANES, m = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < r->span; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < r->span; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        total[j] = sum;
    }
}

/* out += p . v over the row's keys in [lo, hi), key by key in order (out starts at zero). */
static inline __attribute__((always_inline)) void values_chunk(const struct pre_row *r, const float *vf, int64_t lo,
                                                                int64_t hi, const int64_t nh, int64_t head_dim,
                                                                int64_t stride) {
    const int64_t from = r->skip > lo ? r->skip : lo, to = r->skip + r->span < hi ? r->skip + r->span : hi;
    const float *p = r->scores + PRE_LANES - r->skip; /* p[j * stride + t]: head j's weight of key t */
    int64_t c = 0;
    for (; c + PRE_DIMS <= head_dim; c += PRE_DIMS) {
        pre_lanes acc[PRE_HEADS][4];
        for (int64_t j = 0; j < nh; j++)
            for (int k = 0; k < 4; k++) acc[j][k] = pre_load(r->out + j * head_dim + c + k * PRE_LANES);
        for (int64_t t = from; t < to; t++) {
            const float *v = vf + t * head_dim + c;
            const pre_lanes v0 = pre_load(v), v1 = pre_load(v + PRE_LANES), v2 = pre_load(v + 2 * PRE_LANES),
                            v3 = pre_load(v + 3 * PRE_LANES);
            for (int64_t j = 0; j < nh; j++) {
                const pre_lanes w = pre_broadcast(p[j * stride + t]);
                acc[j][0] = pre_fma(w, v0, acc[j][0]);
                acc[j][1] = pre_fma(w, v1, acc[j][1]);
                acc[j][2] = pre_fma(w, v2, acc[j][2]);
                acc[j][3] = pre_fma(w, v3, acc[j][3]);
            }
        }
        for (int64_t j = 0; j < nh; j++)
            for (int k = 0; k < 4; k++) pre_store(r->out + j * head_dim + c + k * PRE_LANES, acc[j][k]);
    }
    for (int64_t j = 0; j < nh; j++)
        for (int64_t i = c; i < head_dim; i++)
            for (int64_t t = from; t < to; t++)
                r->out[j * head_dim + i] = fmaf(p[j * stride + t], vf[t * head_dim + i], r->out[j * head_dim + i]);
}

/* Rows [0, count) of a task over the context's n keys, chunk by chunk: every row's scores, then softmax,
 * then every row's values; a row's sums run in the same order whatever rows share the task. */
static inline __attribute__((always_inline)) void prefill_rows(struct pre_row *rows, int64_t count, const float *kt,
                                                                const float *vf, int64_t n, const int64_t nh,
                                                                int64_t head_dim, int64_t stride, float scale) {
    float total[PRE_ROWS][PRE_HEADS];
    for (int64_t lo = 0; lo < n; lo += PRE_CHUNK)
        for (int64_t r = 0; r < count; r++) score_chunk(rows + r, kt, lo, lo + PRE_CHUNK, nh, head_dim, stride, scale);
    for (int64_t r = 0; r < count; r++) {
        softmax_row(rows + r, nh, stride, total[r]);
        for (int64_t i = 0; i < nh * head_dim; i++) rows[r].out[i] = 0.f;
    }
    for (int64_t lo = 0; lo < n; lo += PRE_CHUNK)
        for (int64_t r = 0; r < count; r++) values_chunk(rows + r, vf, lo, lo + PRE_CHUNK, nh, head_dim, stride);
    for (int64_t r = 0; r < count; r++)
        for (int64_t j = 0; j < nh; j++)
            for (int64_t i = 0; i < head_dim; i++) rows[r].out[j * head_dim + i] /= total[r][j];
}

static void prefill_task(struct pre_row *rows, int64_t count, const float *kt, const float *vf, int64_t n,
                         int64_t nh, int64_t head_dim, int64_t stride, float scale) {
    switch (nh) {
    case 1: prefill_rows(rows, count, kt, vf, n, 1, head_dim, stride, scale); break;
    case 2: prefill_rows(rows, count, kt, vf, n, 2, head_dim, stride, scale); break;
    case 3: prefill_rows(rows, count, kt, vf, n, 3, head_dim, stride, scale); break;
    default: prefill_rows(rows, count, kt, vf, n, PRE_HEADS, head_dim, stride, scale);
    }
}

int paged_prefill_attention(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                            int64_t kv_half, int64_t num_pages, const int64_t *table, int64_t table_len,
                            int64_t start, int64_t rows, float *out, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t page_size, float scale, int64_t window, int num_threads) {
    const int64_t ctx = start + rows, first = window > 0 && start + 1 > window ? start + 1 - window : 0;
    if (rows < 1 || start < 0 || ctx > table_len * page_size) return KVF_BAD_TABLE;
    for (int64_t p = first / page_size; p < (ctx + page_size - 1) / page_size; p++)
        if (table[p] < 0 || table[p] >= num_pages) return KVF_BAD_TABLE;
    const int64_t n = ctx - first, padded = PRE_ROUND(n), group = num_heads / num_kv_heads;
    const int64_t stride = padded + 2 * PRE_LANES; /* floats of a head's scores (see struct pre_row) */
    float *kt = malloc(sizeof(float) * num_kv_heads * head_dim * (padded + n));
    if (kt == NULL) return KVF_NO_MEMORY;
    float *vf = kt + num_kv_heads * head_dim * padded;
    widen_context(k_cache, v_cache, kv_half, table, first, ctx, num_kv_heads, head_dim, page_size, kt, vf);
    int status = KVF_OK;
    const int64_t tiles = (group + PRE_HEADS - 1) / PRE_HEADS, row_tiles = (rows + PRE_ROWS - 1) / PRE_ROWS;
    const int64_t tasks = row_tiles * num_kv_heads * tiles;
#pragma omp parallel num_threads(num_threads) if (tasks > 1)
    {
        float *scores = aligned_alloc(64, (sizeof(float) * PRE_ROWS * PRE_HEADS * stride + 63) / 64 * 64);
        if (scores == NULL) {
#pragma omp atomic write
            status = KVF_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == NULL) continue;
            const int64_t row0 = task / (num_kv_heads * tiles) * PRE_ROWS, g = task / tiles % num_kv_heads;
            const int64_t h0 = g * group + task % tiles * PRE_HEADS;
            const int64_t nh = g * group + group - h0 < PRE_HEADS ? g * group + group - h0 : PRE_HEADS;
            const int64_t count = rows - row0 < PRE_ROWS ? rows - row0 : PRE_ROWS;
            struct pre_row tile[PRE_ROWS];
            for (int64_t r = 0; r < count; r++) {
                const int64_t p = start + row0 + r, row_first = window > 0 && p + 1 > window ? p + 1 - window : 0;
                tile[r] = (struct pre_row){q + (row0 + r) * q_row_stride + h0 * head_dim,
                                           scores + r * PRE_HEADS * stride, out + ((row0 + r) * num_heads + h0) * head_dim,
                                           row_first - first, p + 1 - row_first};
            }
            prefill_task(tile, count, kt + g * head_dim * padded, vf + g * n * head_dim, n, nh, head_dim, stride,
                         scale);
        }
        free(scores);
    }
    free(kt);
    return status;
}
